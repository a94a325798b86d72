"""Local serving's policies (``--local-policy``): what each iteration drafts and verifies.

* ``none`` — plain decoding (no draft), ``chain`` — every request drafts ``k`` tokens;
* ``tetris`` — TETRIS (arXiv 2502.15197, Alg. 1): each request drafts ``k + extra`` tokens and the batch
  verifies the ``capacity`` tokens with the highest cumulative draft probability; VSR reported.
  Sampled tokens are ranked by the confidence known before each was drawn
  (:func:`goodspeed.scheduler.tetris.presample_scores`): ranking by their own sampled values
  would condition them and bias the output;
* ``adaserve`` — AdaServe (arXiv 2501.12162, Alg. 2): beam-search candidate trees with depth and width
  from eqs. (8)-(9), SLO-customized then throughput-optimized node selection under the budget
  ``B``, where ``A(r) = (l + t_spec) / t_TPOT - o`` with ``l`` the time since the request's
  decoding began, ``o`` its tokens so far and ``t_spec`` the smoothed iteration time. When the
  ``n`` requests' roots take the whole budget (``n >= B``) Alg. 2 can select no node, so the
  iteration drafts nothing and decodes plainly;
* ``turbospec`` — TurboSpec (arXiv 2406.14066, Listing 2): ``k`` (0 included) maximising predicted
  goodput under the profiled latency models, from the requests' smoothed acceptance;
* ``nightjar`` — Nightjar (arXiv 2512.22420, Alg. 1): a bandit over ``k`` per batch size, rewarded with
  the measured goodput of the step, with the draft catch-up as the switching cost;
* ``goodput`` — each request's own length (0 included), the batch's most expected tokens per
  second from the requests' measured acceptances and the step's measured costs
  (:mod:`goodspeed.scheduler.paying`): speculation stops where it does not pay.

Adding a policy is one module here with one :class:`LocalPolicy` subclass and its ``name``, and
its line in :data:`LOCAL_POLICY_CLASSES`; ``--local-policy``, the spec's ``local_policy`` and config
validation accept it from there.
"""

from goodspeed.verifier.local_policies.adaserve import AdaServeTrees
from goodspeed.verifier.local_policies.base import LocalPolicy, Plan
from goodspeed.verifier.local_policies.chain import FixedChains
from goodspeed.verifier.local_policies.goodput import GoodputChains
from goodspeed.verifier.local_policies.nightjar import NightjarChains
from goodspeed.verifier.local_policies.none import PlainDecoding
from goodspeed.verifier.local_policies.tetris import TetrisSelection
from goodspeed.verifier.local_policies.turbospec import TurboSpecChains

LOCAL_POLICY_CLASSES: dict[str, type[LocalPolicy]] = {
    cls.name: cls for cls in (PlainDecoding, FixedChains, TetrisSelection, AdaServeTrees, TurboSpecChains, NightjarChains,
                              GoodputChains)
}
LOCAL_POLICIES = tuple(LOCAL_POLICY_CLASSES)

__all__ = ["LOCAL_POLICIES", "LOCAL_POLICY_CLASSES", "LocalPolicy", "Plan"]
