"""ModelConfig: validation, parallel checks and conversion to Megatron's TransformerConfig (CPU, no process groups)."""

import ast
import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron warns about missing TE/apex on import
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lightning_megatron.gpt import config as config_module
    from lightning_megatron.gpt.config import ModelConfig, tiny_gpt
    from lightning_megatron.gpt.specs import layer_spec
    from lightning_megatron.parallel.sizes import ParallelSizes


def test_tiny_gpt_defaults_are_llama_style() -> None:
    cfg = tiny_gpt()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (4, 64, 4)
    assert (cfg.ffn_hidden_size, cfg.vocab_size, cfg.seq_length) == (128, 256, 32)
    assert cfg.normalization == "RMSNorm"
    assert cfg.position_embedding_type == "rope"
    assert cfg.activation == "silu"
    assert cfg.gated_linear_unit
    assert not cfg.add_bias_linear
    assert not cfg.share_embeddings_and_output_weights
    assert tiny_gpt(num_layers=8).num_layers == 8


def test_required_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ModelConfig(2, 8, 2, 16, 8)  # type: ignore[misc]


def test_effective_sizes() -> None:
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=32, seq_length=16)
    assert cfg.effective_num_query_groups == 8
    assert cfg.effective_kv_channels == 8
    assert cfg.effective_ffn_hidden_size == 256
    assert tiny_gpt(num_query_groups=2).effective_num_query_groups == 2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_layers": 0}, r"num_layers=0"),
        ({"hidden_size": -64}, r"hidden_size=-64"),
        ({"vocab_size": 0}, r"vocab_size=0"),
        ({"seq_length": 0}, r"seq_length=0"),
        ({"num_query_groups": 0}, r"num_query_groups=0"),
        ({"ffn_hidden_size": 0}, r"ffn_hidden_size=0"),
        ({"num_layers": 2.0}, r"num_layers=2\.0"),
        (
            {"num_attention_heads": 6, "hidden_size": 60, "num_query_groups": 4},
            r"num_attention_heads=6.*"
            r"num_query_groups=4.*\[1, 2, 3, 6\]",
        ),
        ({"num_attention_heads": 6}, r"hidden_size=64.*num_attention_heads=6"),
        ({"activation": "relu"}, r"activation='relu'.*silu"),
        ({"normalization": "BatchNorm"}, r"normalization='BatchNorm'"),
        ({"position_embedding_type": "alibi"}, r"position_embedding_type='alibi'"),
        ({"hidden_dropout": 1.0}, r"hidden_dropout=1\.0"),
        ({"attention_dropout": -0.1}, r"attention_dropout=-0\.1"),
        ({"rotary_percent": 0.0}, r"rotary_percent=0\.0"),
        ({"rotary_percent": 1.5}, r"rotary_percent=1\.5"),
        ({"norm_epsilon": 0.0}, r"norm_epsilon=0\.0"),
        ({"init_method_std": -1.0}, r"init_method_std=-1\.0"),
        ({"recompute_granularity": "some"}, r"recompute_granularity='some'"),
        ({"recompute_granularity": "full"}, r"recompute_method=None.*'uniform' or 'block'"),
        ({"recompute_granularity": "full", "recompute_method": "uniform"}, r"recompute_num_layers=None.*1 and"),
        (
            {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 5},
            r"recompute_num_layers=5.*num_layers=4",
        ),
        ({"recompute_granularity": "full", "recompute_method": "chunk"}, r"recompute_method='chunk'"),
        ({"recompute_granularity": "selective", "recompute_num_layers": 1}, r"recompute_num_layers=1.*'full'"),
        ({"recompute_granularity": "selective", "recompute_method": "uniform"}, r"recompute_method='uniform'"),
        ({"recompute_method": "block"}, r"recompute_method='block'.*recompute_granularity=None"),
        ({"moe_ffn_hidden_size": 32}, r"moe_ffn_hidden_size=32.*num_moe_experts"),
        ({"num_moe_experts": 1}, r"num_moe_experts=1"),
        ({"num_moe_experts": 4, "moe_router_topk": 8}, r"moe_router_topk=8.*num_moe_experts=4"),
        ({"num_moe_experts": 4, "moe_router_topk": 1}, r"moe_router_topk=1"),
        ({"moe_router_topk": 0}, r"moe_router_topk=0"),
    ],
)
def test_invalid_model_config(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_gpt(**overrides)


def test_valid_recompute_settings() -> None:
    tiny_gpt(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    tiny_gpt(recompute_granularity="full", recompute_method="block", recompute_num_layers=4)
    tiny_gpt(recompute_granularity="selective")


@pytest.mark.parametrize(
    ("cfg_overrides", "parallel", "match"),
    [
        ({}, {"tp": 0, "pp": 1, "vpp": None}, r"tp=0"),
        ({}, {"tp": 1, "pp": 1, "vpp": 0}, r"vpp=0"),
        ({}, {"tp": 1, "pp": 1, "vpp": 2}, r"vpp=2 needs pipeline parallelism, but pp=1"),
        ({}, {"tp": 8, "pp": 1, "vpp": None}, r"num_attention_heads=4 must be divisible by tp=8.*\[1, 2, 4\]"),
        ({"num_query_groups": 2}, {"tp": 4, "pp": 1, "vpp": None}, r"num_query_groups=2.*tp=4.*\[1, 2\]"),
        ({"vocab_size": 250}, {"tp": 4, "pp": 1, "vpp": None}, r"vocab_size=250.*tp=4.*252"),
        ({"num_layers": 6}, {"tp": 1, "pp": 2, "vpp": 2}, r"num_layers=6.*pp\*vpp=2\*2=4.*\[4, 8\].*\[1, 2, 3, 6\]"),
        ({"num_layers": 3}, {"tp": 1, "pp": 2, "vpp": None}, r"num_layers=3.*pp\*vpp=2\*1=2.*\[2, 4\]"),
        (
            {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 4},
            {"tp": 1, "pp": 2, "vpp": None},
            r"recompute_num_layers=4.*1\.\.2",
        ),
        ({}, {"tp": 1, "pp": 1, "vpp": None, "ep": 2}, r"ep=2.*num_moe_experts=None"),
        ({"num_moe_experts": 6}, {"tp": 1, "pp": 1, "vpp": None, "ep": 4}, r"num_moe_experts=6.*ep=4.*\[1, 2, 3, 6\]"),
        (
            {},
            {"tp": 1, "pp": 1, "vpp": None, "sequence_parallel": True},
            r"sequence_parallel=True.*but tp=1; set tp>=2",
        ),
        ({"seq_length": 30}, {"tp": 4, "pp": 1, "vpp": None, "sequence_parallel": True}, r"seq_length=30.*tp=4.*32"),
        ({"seq_length": 30}, {"tp": 1, "pp": 1, "vpp": None, "cp": 2}, r"seq_length=30.*divisible by 4.*cp=2.*32"),
        (
            {"seq_length": 30},
            {"tp": 4, "pp": 1, "vpp": None, "cp": 3, "sequence_parallel": True},
            r"seq_length=30.*divisible by 12.*cp=3.*36",
        ),
    ],
)
def test_invalid_parallel(cfg_overrides: dict, parallel: dict, match: str) -> None:
    cfg = tiny_gpt(**cfg_overrides)
    with pytest.raises(ValueError, match=match):
        cfg.validate_parallel(ParallelSizes(**parallel))


def test_valid_parallel() -> None:
    tiny_gpt().validate_parallel(ParallelSizes(tp=4, pp=2, vpp=2, sequence_parallel=True))


def test_context_parallel_needs_an_attention_that_splits_sequences() -> None:
    with pytest.raises(ValueError, match=r"cp=2 with kernels='local'"):
        tiny_gpt(kernels="local").validate_parallel(ParallelSizes(cp=2))
    tiny_gpt().validate_parallel(ParallelSizes(cp=2))  # 'auto' resolves to the torch-native attention under CP
    tiny_gpt(num_moe_experts=4).validate_parallel(ParallelSizes(tp=2, ep=4))
    tiny_gpt(num_query_groups=2).validate_parallel(ParallelSizes(tp=2, pp=4))


def test_to_transformer_config_maps_fields() -> None:
    cfg = tiny_gpt(num_query_groups=2, norm_epsilon=1e-6, qk_layernorm=True, init_method_std=0.01)
    tc = cfg.to_transformer_config(tensor_model_parallel_size=1, params_dtype=torch.float32)
    assert isinstance(tc, TransformerConfig)
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads) == (4, 64, 4)
    assert tc.num_query_groups == 2
    assert tc.kv_channels == 16
    assert tc.ffn_hidden_size == 128
    assert tc.activation_func is F.silu
    assert tc.gated_linear_unit is True
    assert tc.normalization == "RMSNorm"
    assert tc.layernorm_epsilon == 1e-6
    assert tc.qk_layernorm is True
    assert tc.add_bias_linear is False
    assert tc.add_qkv_bias is False
    assert tc.hidden_dropout == 0.0
    assert tc.attention_dropout == 0.0
    assert tc.init_method_std == 0.01
    assert tc.num_moe_experts is None
    assert tc.transformer_impl == "local"
    for fused in (
        "apply_rope_fusion",
        "masked_softmax_fusion",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "gradient_accumulation_fusion",
        "persist_layer_norm",
    ):
        assert getattr(tc, fused) is False, fused


def test_to_transformer_config_defaults_and_gelu() -> None:
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=16,
        activation="gelu",
        normalization="LayerNorm",
        gated_linear_unit=False,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    tc = cfg.to_transformer_config()
    assert tc.activation_func is F.gelu
    assert tc.normalization == "LayerNorm"
    assert tc.num_query_groups == 4
    assert tc.ffn_hidden_size == 128
    assert tc.kv_channels == 8
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)


def test_to_transformer_config_passes_parallel_through() -> None:
    cfg = tiny_gpt()
    tc = cfg.to_transformer_config(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        context_parallel_size=2,
        sequence_parallel=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
        calculate_per_token_loss=True,
    )
    assert tc.tensor_model_parallel_size == 2
    assert tc.pipeline_model_parallel_size == 2
    assert tc.virtual_pipeline_model_parallel_size == 2
    assert tc.context_parallel_size == 2
    assert tc.sequence_parallel is True
    assert tc.params_dtype is torch.bfloat16
    assert tc.pipeline_dtype is torch.bfloat16
    assert tc.bf16 is True
    assert tc.calculate_per_token_loss is True


def test_to_transformer_config_moe() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "moe_ffn_hidden_size is not set" fallback warning
        tc = tiny_gpt(num_moe_experts=4).to_transformer_config(expert_model_parallel_size=2)
    assert tc.num_moe_experts == 4
    assert tc.moe_router_topk == 2
    assert tc.moe_ffn_hidden_size == 128
    assert tc.expert_model_parallel_size == 2
    assert tiny_gpt(num_moe_experts=4, moe_ffn_hidden_size=32).to_transformer_config().moe_ffn_hidden_size == 32


MOE = {"num_moe_experts": 4}
SIGMOID = {**MOE, "moe_router_score_function": "sigmoid"}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        # A dense model has no router: each MoE-only field is refused, named, with what would work.
        ({"moe_router_pre_softmax": True}, r"moe_router_pre_softmax=True needs an MoE model.*num_moe_experts=None"),
        ({"moe_router_score_function": "sigmoid"}, r"moe_router_score_function='sigmoid' needs an MoE model"),
        ({"moe_router_enable_expert_bias": True}, r"moe_router_enable_expert_bias=True needs an MoE model"),
        ({"moe_router_bias_update_rate": 0.01}, r"moe_router_bias_update_rate=0\.01 needs an MoE model"),
        ({"moe_router_num_groups": 2}, r"moe_router_num_groups=2 needs an MoE model"),
        ({"moe_router_group_topk": 1}, r"moe_router_group_topk=1 needs an MoE model"),
        ({"moe_router_topk_scaling_factor": 2.5}, r"moe_router_topk_scaling_factor=2\.5 needs an MoE model"),
        ({"moe_router_load_balancing_type": "seq_aux_loss"}, r"moe_router_load_balancing_type='seq_aux_loss' needs"),
        ({"moe_aux_loss_coeff": 0.01}, r"moe_aux_loss_coeff=0\.01 needs an MoE model.*moe_aux_loss_coeff=0\.0"),
        ({"moe_z_loss_coeff": 0.001}, r"moe_z_loss_coeff=0\.001 needs an MoE model.*moe_z_loss_coeff=None"),
        ({"moe_shared_expert_intermediate_size": 64}, r"moe_shared_expert_intermediate_size=64 needs an MoE model"),
        ({"moe_shared_expert_gate": True}, r"moe_shared_expert_gate=True needs an MoE model"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq=2 needs an MoE model.*moe_layer_freq=1"),
        ({"moe_grouped_gemm": False}, r"moe_grouped_gemm=False needs an MoE model.*moe_grouped_gemm=None"),
        # Routing: what Megatron's TransformerConfig rejects (or ignores), refused before anything is built.
        ({**MOE, "moe_router_score_function": "relu"}, r"moe_router_score_function='relu'.*softmax.*sigmoid"),
        ({**SIGMOID, "moe_router_pre_softmax": True}, r"moe_router_pre_softmax=True with .*'sigmoid'.*=False"),
        ({**MOE, "moe_router_topk": 1}, r"moe_router_topk=1 .*moe_router_pre_softmax=True"),
        ({**MOE, "moe_router_enable_expert_bias": True}, r"moe_router_enable_expert_bias=True with .*'softmax'"),
        (
            {**SIGMOID, "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": -0.001},
            r"moe_router_bias_update_rate=-0\.001 must be >= 0",
        ),
        ({**SIGMOID, "moe_router_bias_update_rate": 0.01}, r"moe_router_bias_update_rate=0\.01 only applies with"),
        ({**MOE, "moe_router_group_topk": 1}, r"moe_router_group_topk=1 without moe_router_num_groups"),
        ({**MOE, "moe_router_num_groups": 2}, r"moe_router_num_groups=2 without moe_router_group_topk"),
        (
            {**MOE, "moe_router_num_groups": 3, "moe_router_group_topk": 1},
            r"moe_router_num_groups=3 must divide num_moe_experts=4.*\[1, 2, 4\]",
        ),
        (
            {**MOE, "moe_router_num_groups": 2, "moe_router_group_topk": 3},
            r"moe_router_group_topk=3 must be <= moe_router_num_groups=2",
        ),
        (  # one expert per group, top-2 from one group: Megatron would route to masked-out experts
            {**MOE, "moe_router_num_groups": 4, "moe_router_group_topk": 1},
            r"moe_router_group_topk=1 with moe_router_num_groups=4 .*among \[2\]",
        ),
        ({**MOE, "moe_router_num_groups": 0, "moe_router_group_topk": 1}, r"moe_router_num_groups=0"),
        ({**MOE, "moe_router_topk_scaling_factor": 0.0}, r"moe_router_topk_scaling_factor=0\.0 must be > 0.*None"),
        # Losses.
        ({**MOE, "moe_router_load_balancing_type": "sinkhorn"}, r"moe_router_load_balancing_type='sinkhorn'"),
        ({**MOE, "moe_aux_loss_coeff": -0.1}, r"moe_aux_loss_coeff=-0\.1 must be >= 0"),
        (
            {**MOE, "moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": "none"},
            r"moe_aux_loss_coeff=0\.01 with moe_router_load_balancing_type='none'.*'aux_loss'",
        ),
        ({**MOE, "moe_z_loss_coeff": 0.0}, r"moe_z_loss_coeff=0\.0 must be > 0.*None to turn the z-loss off"),
        # Shared experts, layer pattern, grouped GEMM.
        ({**MOE, "moe_shared_expert_intermediate_size": 0}, r"moe_shared_expert_intermediate_size=0"),
        ({**MOE, "moe_shared_expert_gate": True}, r"moe_shared_expert_gate=True .*moe_shared_expert_intermediate_size"),
        ({**MOE, "moe_layer_freq": 0}, r"moe_layer_freq=0 must be >= 1"),
        ({**MOE, "moe_layer_freq": "1,0"}, r"moe_layer_freq='1,0' must be an int >= 1 or a tuple"),
        ({**MOE, "moe_layer_freq": (1, 0)}, r"moe_layer_freq=\(1, 0\) .*4 entries for num_layers=4"),
        ({**MOE, "moe_layer_freq": (0, 2, 1, 0)}, r"moe_layer_freq=\(0, 2, 1, 0\) must hold one 0"),
        ({**MOE, "moe_layer_freq": [0, 0, 0, 0]}, r"moe_layer_freq=\(0, 0, 0, 0\) makes every layer dense"),
        ({**MOE, "moe_grouped_gemm": "yes"}, r"moe_grouped_gemm='yes' must be None \(auto\), True or False"),
    ],
)
def test_invalid_moe_config(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_gpt(**overrides)


def test_moe_router_settings_reach_megatron() -> None:
    """Top-1 is accepted where it has a gradient; the fields pass to TransformerConfig under their names (the layer
    pattern as Megatron's list; grouped GEMMs unless False), and Megatron's own checks accept every combination."""
    assert tiny_gpt(**MOE, moe_router_topk=1, moe_router_pre_softmax=True).moe_router_topk == 1
    assert tiny_gpt(**SIGMOID, moe_router_topk=1).moe_router_topk == 1
    cfg = tiny_gpt(
        **SIGMOID, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2, moe_router_num_groups=2,
        moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True, moe_layer_freq=[0, 1, 1, 1], moe_grouped_gemm=False,
    )  # fmt: skip
    assert cfg.moe_layer_freq == (0, 1, 1, 1)  # a YAML list, kept as a tuple
    assert cfg.moe_layers == (False, True, True, True)
    assert tiny_gpt(**MOE, moe_layer_freq=2).moe_layers == (True, False, True, False)  # layer i MoE iff i % 2 == 0
    assert tiny_gpt().moe_layers == (False,) * 4
    tc = cfg.to_transformer_config()
    for name in ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                 "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
                 "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                 "moe_shared_expert_intermediate_size", "moe_shared_expert_gate"):  # fmt: skip
        assert getattr(tc, name) == getattr(cfg, name), name
    assert tc.moe_layer_freq == [0, 1, 1, 1]
    assert tc.moe_grouped_gemm is False
    assert tc.moe_token_dispatcher_type == "allgather"
    softmax = tiny_gpt(**MOE, moe_router_pre_softmax=True).to_transformer_config()
    assert softmax.moe_router_pre_softmax is True
    assert softmax.moe_grouped_gemm is True  # None: grouped where the device has them (the experts module decides)
    assert tiny_gpt(**MOE, moe_grouped_gemm=False).to_transformer_config().moe_grouped_gemm is False
    # The strategy's variable-length dispatcher is no clash.
    assert tiny_gpt(**MOE).to_transformer_config(moe_token_dispatcher_type="alltoall").moe_token_dispatcher_type == (
        "alltoall"
    )


def test_to_transformer_config_rejects_model_fields_as_parallel() -> None:
    with pytest.raises(ValueError, match=r"num_layers"):
        tiny_gpt().to_transformer_config(num_layers=8)


def test_gpt_model_kwargs() -> None:
    kwargs = tiny_gpt(share_embeddings_and_output_weights=True, rotary_base=500000).gpt_model_kwargs()
    assert kwargs == {
        "vocab_size": 256,
        "max_sequence_length": 32,
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_base": 500000,
        "share_embeddings_and_output_weights": True,
    }


def test_layer_spec() -> None:
    spec = layer_spec(tiny_gpt())
    assert isinstance(spec, ModuleSpec)
    moe_spec = layer_spec(tiny_gpt(num_moe_experts=4, qk_layernorm=True))
    assert isinstance(moe_spec, ModuleSpec)
    assert moe_spec.submodules.mlp is not spec.submodules.mlp
    dense_in_moe = layer_spec(tiny_gpt(num_moe_experts=4), moe=False)  # a dense layer of an MoE model
    assert dense_in_moe.submodules.mlp.func == spec.submodules.mlp.func  # MLP.as_mlp_submodule
    assert moe_spec.submodules.mlp.func.__name__ == "QueuedCountsMoELayer"  # Megatron's MoELayer, gpt/moe/dispatch.py


def test_every_field_has_a_docstring() -> None:
    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
    documented = set()
    for stmt, nxt in zip(cls.body, [*cls.body[1:], None], strict=True):
        if isinstance(stmt, ast.AnnAssign):
            name = stmt.target.id  # type: ignore[attr-defined]
            ok = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
            assert ok, f"ModelConfig.{name} has no docstring"
            assert nxt.value.value.strip(), f"ModelConfig.{name} has an empty docstring"  # type: ignore[union-attr]
            documented.add(name)
    assert documented == {f.name for f in dataclasses.fields(ModelConfig)}
