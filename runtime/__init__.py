"""How a stage's process runs: its place in the torchrun world (world) and its command line built
from a config dataclass's fields and docstrings (cli)."""
