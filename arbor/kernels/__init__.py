"""CPU C kernels, their build-and-load (``native``) and the process allocator tuning; each loader
answers ``None`` / unavailable where the kernel cannot run, and its caller takes the PyTorch path.
Imports nothing of Arbor."""
