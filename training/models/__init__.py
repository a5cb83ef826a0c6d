"""The models a run trains: the bundled DeepSeek-style presets (MLA attention, MoE
feed-forward, byte-level). Imports training.errors, and training.sync.buckets to count a
preset's sync buckets."""
