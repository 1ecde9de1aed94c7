"""drift's golden trajectories: shipped inside the package as ``drift._golden`` (pyproject.toml maps
this folder there), found by :func:`drift.check.golden.golden_dir` from any install."""
