//! stub: simulated executor (being written)
