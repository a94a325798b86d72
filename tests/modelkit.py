"""Tiny models built from configs (never downloaded) and the obvious references tests compare with."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int, vocab: int = 48, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, init: float = 0.3, dtype=torch.float64):
    """A random Llama with large init so its distributions are peaked (greedy ties are rare)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def perturbed(model, scale: float, seed: int):
    """A draft correlated with ``model``: the same weights plus Gaussian noise."""
    torch.manual_seed(seed)
    clone = type(model)(model.config).to(next(model.parameters()).dtype)
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return clone.eval()


def greedy_reference(model, prompt, max_new_tokens):
    """The target's own greedy decoding, recomputed from scratch every step (no cache)."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    return seq[len(prompt) :]


def reference_ranks(row, token: int, atol: float = 1e-4) -> range:
    """The ranks (vLLM's: tokens at least as probable, itself included) that ``token`` may have in
    a reference log-probability row, allowing for ``atol`` between the reference and the engine."""
    value = float(row[token])
    return range(int((row > value + atol).sum()) + 1, int((row >= value - atol).sum()) + 1)


def adjusted_greedy_reference(model, prompt, sampling, max_new_tokens, generated=0, eos=None):
    """The target's own greedy decoding with ``sampling``'s logit bias and penalties (and grammar),
    each step's logits adjusted by the text before it (``statkit.reference_adjust``), recomputed
    from scratch. ``generated``: the prompt's last tokens are output already (the penalties count
    them so). ``eos``: the text ends at this token (kept in the output)."""
    from statkit import reference_adjust

    seq, split = list(prompt), len(prompt) - generated
    with torch.inference_mode():
        while len(seq) - len(prompt) < max_new_tokens and (eos is None or len(seq) == len(prompt) or seq[-1] != eos):
            logits = reference_adjust(model(input_ids=torch.tensor([seq])).logits[0, -1], sampling, seq[:split], seq[split:])
            seq.append(int(torch.argmax(logits)))
    return seq[len(prompt):]


def save_models(root, models: dict, vocab_size: int):
    """Save each model with one shared byte-level BPE tokenizer (so fingerprints match); returns paths."""
    from goodspeed.lm.models.demo import train_tokenizer

    tokenizer = train_tokenizer("def f(x):\n    return x + 1\n" * 50, vocab_size=vocab_size)
    paths = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths


def chat_pair(vocab_size: int = 300):
    """A tiny target, a perturbed draft and a byte-level BPE tokenizer with the demo's chat
    template, all of one vocabulary (for the HTTP API tests)."""
    import inspect
    import json

    from goodspeed.lm.models.demo import train_tokenizer

    tokenizer = train_tokenizer(inspect.getsource(json.decoder) * 3, vocab_size=vocab_size)
    target = tiny_llama(0, vocab=vocab_size)
    return target, perturbed(target, 0.05, 1), tokenizer


# A device's or a service's recurring instructions: one domain of traffic for drafts that adapt
DOMAIN_PREFIXES = ([1, 2, 3, 4, 5], [9, 8, 7, 6, 5], [20, 21, 22, 23, 24])


def domain_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of one domain: one of a few prefixes and a varying last token."""
    g = torch.Generator().manual_seed(seed)
    return [DOMAIN_PREFIXES[int(torch.randint(0, len(DOMAIN_PREFIXES), (1,), generator=g))]
            + torch.randint(0, 16, (1,), generator=g).tolist() for _ in range(count)]


def domain_traffic(target, count: int, new_tokens: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """``(prompt length, prompt + the target's greedy answer)`` for ``count`` domain prompts."""
    return [(len(p), p + greedy_reference(target, p, new_tokens)) for p in domain_prompts(count, seed)]


def copy_of(model):
    """An independent copy of a model (its own weights)."""
    clone = type(model)(model.config).to(next(model.parameters()).dtype)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def far_pair(vocab: int = 48):
    """A tiny target and a draft far from it (little to lose, much to learn: for drafts that adapt)."""
    target = tiny_llama(0, vocab=vocab)
    return target, perturbed(target, 1.0, 7)
