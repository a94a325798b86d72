"""Random streams: independent by construction across roles and names, reproducible from a root."""

import pytest
import torch

from goodspeed.lm.decoding.seeding import numpy_rng, resolve_root_seed, stream_seed, torch_generator


def test_same_root_and_domain_is_the_same_stream():
    assert stream_seed(7, "drafter", "edge-1") == stream_seed(7, "drafter", "edge-1")
    a, b = torch_generator(7, "verifier", "verify"), torch_generator(7, "verifier", "verify")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert numpy_rng(7, "x").random() == numpy_rng(7, "x").random()


def test_roles_names_and_roots_separate_streams():
    domains = [("drafter", "a"), ("drafter", "b"), ("verifier", "verify"), ("verifier", "local-draft"),
               ("verifier", "policy"), ("drafter", "a b"), ("drafter a", "b")]
    seeds = {stream_seed(0, *d) for d in domains} | {stream_seed(1, *d) for d in domains}
    assert len(seeds) == 2 * len(domains)
    # The defect this prevents: two generators seeded with one integer yield the same uniforms
    # whatever the shapes, so a drafter's sampling uniform was the verifier's accept uniform.
    same = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.rand(1, generator=same[0], dtype=torch.float64) == torch.rand(1, 2, generator=same[1], dtype=torch.float64)[0, 0]
    drafter, verifier = torch_generator(3, "drafter", "d"), torch_generator(3, "verifier", "verify")
    assert torch.rand(1, generator=drafter, dtype=torch.float64) != torch.rand(1, 2, generator=verifier, dtype=torch.float64)[0, 0]


def test_no_seed_means_fresh_entropy():
    roots = {resolve_root_seed(None) for _ in range(5)}
    assert len(roots) == 5 and all(0 <= r < 2**63 for r in roots)
    assert resolve_root_seed(12) == 12


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_seeds_and_domains_are_refused(bad):
    with pytest.raises(ValueError):
        resolve_root_seed(bad)


def test_a_domain_is_needed():
    with pytest.raises(ValueError):
        stream_seed(0)
    with pytest.raises(ValueError):
        stream_seed(0, "drafter", 3)
