"""Jobs built on checked runs: bench, nightly, teeth (mutants, trade-off), reports and plots."""
