"""The `draftcache` command: every stage's command line under one name (draftcache.command)."""
