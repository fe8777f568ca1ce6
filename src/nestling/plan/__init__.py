"""`nestling plan`: what a draft for a target will cost (disk, GPU memory, time) before anything loads."""
