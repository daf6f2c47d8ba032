"""Weight-only int8 / int4: the quantized weight and its kernels (weights), and quantizing a rank's slice
while it is read (load)."""
