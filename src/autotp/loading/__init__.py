"""Reading weights: the safetensors checkpoint a rank reads its slices from (checkpoint), the model built
on the meta device before any weight exists (skeleton), and giving freed heap back (memory)."""
