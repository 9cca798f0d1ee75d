"""Stage two: train DFlash drafters from a draftcache store; evaluate and export them."""
