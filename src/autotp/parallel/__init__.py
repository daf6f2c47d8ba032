"""The partition and the sharded runtime: which slice of each tensor a rank holds (partition, slices,
styles, layout), and the per-rank model that runs with it (shard, layers, collectives, head_inputs,
input_guard). Knows no file format and no front end."""
