"""The shipped Grafana dashboard queries only metrics that the verifier or an edge node exports."""

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

import goodspeed.launch
from goodspeed.serving.metrics import DrafterMetrics, RequestMetrics, SpecDecodeMetrics
from goodspeed.verifier.observability import Metrics

DASHBOARD = Path(goodspeed.launch.__file__).parent / "grafana" / "goodspeed.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(registry) -> dict[str, set[str]]:
    """Sample names -> label names (``le`` aside), as a scrape of ``registry`` would show them."""
    out = {}
    for family in registry.collect():
        for suffix in SUFFIXES[family.type]:
            out.setdefault(family.name + suffix, set())
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(k for k in sample.labels if k != "le")
    return out


def test_every_metric_the_dashboard_queries_is_exported():
    verifier = Metrics()
    verifier.phase_seconds.labels(phase="forward").observe(0.01)  # labelled metrics show their labels once used
    node = CollectorRegistry()
    for requests, spec in ((verifier.requests, verifier.spec), (RequestMetrics(node), SpecDecodeMetrics(node))):
        requests.track(3).finish("stop")
        spec.observe(4, 2)
    DrafterMetrics(node)
    names = {**exported(verifier.registry), **exported(node)}
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
    queried = {m for e in exprs for m in re.findall(r"goodspeed:[a-z0-9_:]+", e)}
    assert queried and queried <= set(names), sorted(queried - set(names))
    # the label names the dashboard groups by exist on what it groups
    for expr in exprs:
        for by in re.findall(r"by \(([^)]*)\)", expr):
            metrics = re.findall(r"goodspeed:[a-z0-9_:]+", expr.split(f"by ({by})", 1)[1])
            for label in (x.strip() for x in by.split(",")):
                if label != "le":
                    assert label in names[metrics[0]], (expr, label)
