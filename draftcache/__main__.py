"""python -m draftcache: the `draftcache` command (draftcache.command)."""

from draftcache.command import main

if __name__ == "__main__":
    main()
