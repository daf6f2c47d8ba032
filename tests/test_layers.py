"""The parallel layers on their own: traceable by torch.compile, thanks to functional collectives."""

from tasks import compiled_layers


def test_parallel_layers_compile_without_graph_breaks(pools, checkpoint):
    model_dir, _ = checkpoint("mqa10")
    for result in pools(2).run(compiled_layers, model_dir, timeout=300):
        assert result == {"wte": True, "mlp_proj": True, "lm_head": True}
