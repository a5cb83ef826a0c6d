"""The models a run trains: the bundled DeepSeek-style presets (deepseek: MLA attention,
MoE feed-forward, byte-level), `hf:<dir>` causal LMs built by transformers from a local
directory (hf), the lab's own `python:<module>:<callable>` factories (factory), the one
entry and loss contract over all three (build), and the export of trained weights as a
directory transformers loads (export). Imports training.errors, and training.sync.buckets
to count a preset's sync buckets."""
