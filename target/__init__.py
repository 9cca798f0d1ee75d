"""The target model both stages read: loading an HF directory or a GGUF file (loader), the cache of
GGUF conversions (converted), and the tapped layers' capture. The store (cache_format) records what
was loaded; training never loads the target, only evaluation does."""
