"""Experiments: fairness runs of the draft-length policies (experiment.py), their reports
(report.py) and comparisons (compare.py), the calibrated simulator (simulate.py, fitted on run
profiles: sim_profiles.py, profiles/) and the SLO load generator (loadgen.py)."""
