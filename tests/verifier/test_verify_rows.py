import numpy as np
import torch

from goodspeed.lm.decoding.sampling import process_logits
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.drafts import dense_q
from goodspeed.verifier.rejection import verify_tree
from goodspeed.verifier.types import Draft, SparseProbs
from goodspeed.verifier.verify_rows import RowInput, RowVerifier


def test_sampled_trees_processed_together_verify_as_each_row_alone():
    """Sampled tree rows of different sizes and sampling settings, verified in one batch (their
    logits processed in one pass), give each row the outcome of processing its own logits and
    walking its tree alone with the same uniforms."""
    vocab, gen = 30, torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    settings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5),
                SamplingParams(temperature=1.2, top_p=0.8), SamplingParams(temperature=1.0)]
    trees = [[-1, -1, 0], [-1], [-1, 0, 0, 1], [-1, -1]]
    rows, given = [], {}
    for r, (sampling, parents) in enumerate(zip(settings, trees)):
        tokens = rng.choice(vocab, len(parents), replace=False).tolist()
        sparse = [SparseProbs(rng.choice(vocab, 4, replace=False).tolist() + [tok], rng.dirichlet(np.ones(5)).tolist())
                  for tok in tokens]
        draft = Draft(0, tokens, parents, sparse_probs=sparse if r % 2 == 0 else None)
        rows.append(RowInput(f"r{r}", [int(rng.integers(vocab)), *tokens], draft, sampling))
    logits = torch.randn(len(rows), 5, vocab, generator=gen) * 3
    verifier = RowVerifier(vocab, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(1))
    for trial in range(20):
        for row in rows:
            given[row.key] = rng.random(row.draft.num_tokens + 1)
        got = verifier.verify(rows, logits, given)
        for b, row in enumerate(rows):
            n = row.draft.num_tokens
            p = process_logits(logits[b, : n + 1], row.sampling)
            want = verify_tree(p, torch.tensor(row.tokens[1:]), list(row.draft.parents),
                               torch.as_tensor(given[row.key][: n + 1]), dense_q(row.draft, vocab, torch.float32))
            assert got[b].kept == [0] + [node + 1 for node in want.accepted_nodes]
            assert got[b].emitted[-1] == want.next_token and got[b].ratios == want.tested_ratios
