"""Exact rematerialization: the autograd function that reruns a layer; the RNG, call and autocast capture."""
