"""Chat data both stages read: conversations in JSONL (and their prompt keys), the packaged prompt
sets (training, validation, the evaluation's held-out test). `python -m chat prompts` writes one."""
