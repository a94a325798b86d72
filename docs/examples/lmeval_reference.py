"""The target's own log-likelihoods for the pairs lmeval_loglikelihood.py printed (project venv: transformers 5).
Usage: python lmeval_loglikelihood.py BASE_URL MODEL | python lmeval_reference.py TARGET_DIR"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
target_path = sys.argv[1]
data = json.loads(sys.stdin.read().split("RESULT ", 1)[1])
tok = AutoTokenizer.from_pretrained(target_path)
target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
for (ctx, cont), (ll, greedy) in zip(data["pairs"], data["got"]):
    c = tok(ctx, add_special_tokens=False)["input_ids"]
    whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
    ids = whole if whole[: len(c)] == c else c + tok(cont, add_special_tokens=False)["input_ids"]
    n = len(ids) - len(c)
    with torch.no_grad():
        rows = torch.log_softmax(target(torch.tensor([ids])).logits[0].float(), -1)[len(ids) - n - 1 : -1]
    want = rows.gather(1, torch.tensor(ids[-n:]).unsqueeze(1)).sum().item()
    want_greedy = bool((rows.argmax(-1) == torch.tensor(ids[-n:])).all())
    print(f"{ctx!r} + {cont!r}: lm_eval {ll:.4f} greedy={greedy}  target {want:.4f} greedy={want_greedy}")
