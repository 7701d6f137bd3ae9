"""A diffusion stage over several ranks: sequence parallel (Ulysses, ring) and CFG parallel.

layout.py: the ranks and the start-up checks; rank.py: what every rank runs per call;
attention.py: the attention exchange; driver.py: rank 0 (in the engine core) starting and
driving the others; worker.py: the other ranks' processes.
"""
