"""Stage one: run a target LLM over chat data and write tapped hidden states into a draftcache
store."""
