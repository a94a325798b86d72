"""Manual integration check, not run by the tests: lm-evaluation-harness 0.4.13's local-completions
model against a GoodSpeed server (its remote tokenizer, loglikelihood and generate_until). Run with
lm-eval on the path (it needs transformers 4, so apart from this project's environment); pipe the
output to lmeval_reference.py, which computes the target's own log-likelihoods (docs/API.md,
*Evaluating with lm-evaluation-harness*). Usage: python lmeval_loglikelihood.py BASE_URL MODEL"""
import sys

base, model = sys.argv[1:3]
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

lm = LocalCompletionsAPI(base_url=f"{base}/v1/completions", model=model, tokenizer_backend="auto", tokenized_requests=True,
                         num_concurrent=1, max_retries=1, timeout=120)
print("tokenizer backend:", lm.tokenizer_backend, type(lm.tokenizer).__name__)
pairs = [("def f(x):", "\n    return x"), ("import os\nimport", " sys"), ("for i in range(", "10):")]
reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
got = lm.loglikelihood(reqs)
gen = lm.generate_until([Instance(request_type="generate_until", doc={}, idx=0,
                                  arguments=("def parse(self, s):", {"until": ["\n\n"], "max_gen_toks": 24, "temperature": 0}))])
print("generate_until:", repr(gen[0]))

import json
print("RESULT", json.dumps({"pairs": pairs, "got": got}))
