//! stub: `kv replay` (being written)
