"""Tiny HF configs and helpers shared by the model tests."""

import pytest
import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
NEXT = dict(shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)


def hf_config(kind: str):
    import transformers as tf
    if kind == "qwen3":
        return tf.Qwen3Config(**TINY)
    if kind == "qwen3_hd16":   # head_dim a multiple of 16: the CPU prefill kernel's shapes
        return tf.Qwen3Config(**(TINY | dict(head_dim=16)))
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**TINY, **MOE, norm_topk_prob=True)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**TINY, **MOE, **NEXT)
    if kind == "qwen2":
        return tf.Qwen2Config(**TINY)
    if kind == "llama":   # llama3 RoPE with a short original context, so all three frequency bands occur
        return tf.LlamaConfig(**(TINY | dict(head_dim=16)), attention_bias=True, mlp_bias=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    if kind == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=None)
    raise KeyError(kind)


ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "qwen3_hd16": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM"}
DENSE_FAMILIES = ["qwen2", "llama", "mistral"]   # no q/k norm; biases and RoPE variants per family


def hf_model(kind: str, seed: int = 0):
    """A transformers model with every weight perturbed away from its structured init."""
    import transformers as tf
    torch.manual_seed(seed)
    cls = getattr(tf, ARCHITECTURE[kind])
    model = cls(hf_config(kind)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(params=["qwen3", "qwen3_moe", "qwen3_next"])
def kind(request):
    return request.param


@pytest.fixture(params=["qwen3", "qwen3_moe", "qwen3_next", *DENSE_FAMILIES])
def family(request):
    """Every HF architecture Arbor loads (``kind``: the Qwen3 ones, which the tree and MoE tests use)."""
    return request.param


@pytest.fixture
def hf_folder(tmp_path, family):
    model = hf_model(family)
    model.save_pretrained(tmp_path / family)
    return model, tmp_path / family


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on a shared 2-core machine run far faster single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Markers (registered in pyproject.toml). `pytest -m "not slow"` runs the in-process unit tests
# in about a minute; `make test` runs everything; `make test-isa` reruns the `numerics` tests under
# other instruction sets. Each entry: a file, or file::test for one test of a file.
MARKS = {
    "multiprocess": [   # child processes: ranks, `arbor` CLI runs, servers started as programs
        "test_dist.py", "test_pd_multiplex.py", "test_serve_ranks.py", "test_routepack_migration.py",
        "test_cli_determinism.py", "test_server_shutdown.py", "test_allocator.py", "test_sandbox.py", "test_sandbox_view.py",
        "test_python_tool.py::test_demonstrations_run_in_the_sandbox_and_print_the_answer",
        "test_plan.py::test_plan_package_imports_no_torch", "test_engine_cli.py::test_python_dash_m_arbor_is_the_arbor_command",
        "test_rl_objectives.py::test_invalid_overrides_exit_2_with_the_key_named_before_anything_runs",
        "test_rl_overlap.py::test_overlap_keys_are_validated",
        "test_diffusion_server.py::test_arbor_serve_serves_a_block_diffusion_folder", "test_agent_example.py"],
    "ray": ["test_cluster.py", "test_bench_cluster.py"],
    "server_load": ["test_server_load.py", "test_server_hardening.py::test_health_stays_fast_while_busy_and_rejecting_a_20mb_prompt"],
    "bench": ["test_bench_*.py", "test_tree_bench.py", "test_diffusion_bench.py", "test_dllm_rl_bench.py", "test_agent_bench.py",
              "test_rl_overlap.py::test_bench_rl_times_both_schedules"],
    "numerics": [       # results that depend on kernels and instruction sets: float equalities, greedy tokens
        "test_model_attention.py", "test_tree_model.py", "test_tree_batch.py", "test_gated_deltanet.py", "test_moe.py",
        "test_models_hf.py", "test_cpu_ops.py", "test_precision.py", "test_engine_cpu_kernels.py", "test_engine_greedy.py",
        "test_engine_sampling.py", "test_engine_async.py", "test_engine_config.py", "test_layerkv.py", "test_sft.py",
        "test_train_resume.py", "test_losses.py", "test_rl_loop.py", "test_rl_objectives.py", "test_rl_overlap.py",
        "test_rl_engine_copy.py", "test_ebpo.py", "test_ebpo_trainer.py", "test_tad.py", "test_tad_delta.py",
        "test_diffusion_train.py", "test_diffusion_decode.py", "test_server.py", "test_dist.py",
        "test_cli_determinism.py", "test_routepack_migration.py", "test_bench_rl.py", "test_agent_rollout.py",
        "test_engine_moe_paths.py", "test_moe_kernel_large_activations.py", "test_small_linear.py", "test_fp32_gemm.py",
        "test_block_attention.py", "test_decode_stack.py"],
}
SLOW = ("multiprocess", "ray", "server_load", "bench")


def pytest_collection_modifyitems(config, items):
    from fnmatch import fnmatch
    for item in items:
        file, test = item.path.name, item.originalname
        for mark, where in MARKS.items():
            if any(fnmatch(file, w) if "::" not in w else w == f"{file}::{test}" for w in where):
                item.add_marker(mark)
        if any(item.get_closest_marker(m) for m in SLOW):
            item.add_marker("slow")
