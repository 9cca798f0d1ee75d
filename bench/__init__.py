"""draftcache's benchmarks: `python -m bench SUITE [flags]` (see bench/__main__.py and bench/suites/)."""
