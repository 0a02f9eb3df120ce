"""The GPT workload: model shape and causality, determinism, the stdlib corpus split, evaluation."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from geoloco.algorithms.workload import Workload
from geoloco.scenarios.workloads import (
    GPT,
    GPT_PRESETS,
    CorpusUnavailableError,
    GPTConfig,
    GPTWorkload,
    GPTWorkloadConfig,
)
from geoloco.scenarios.workloads.corpus import (
    DOCUMENT_SEPARATOR,
    read_source_files,
    resolve_root,
    split_corpus,
)


def tiny(**overrides: object) -> GPTWorkload:
    return GPTWorkload(GPTWorkloadConfig(size="tiny", batch_size=4, eval_batches=2, **overrides))


def take(stream, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(stream, count))


def test_is_a_workload() -> None:
    workload = tiny()
    assert isinstance(workload, Workload)
    assert workload.name == "gpt"


def test_forward_shape_and_block_size_limit() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    logits = model(torch.randint(0, 256, (3, 8)))
    assert logits.shape == (3, 8, 256)
    with pytest.raises(ValueError, match="block_size 8"):
        model(torch.randint(0, 256, (1, 9)))


def test_attention_is_causal() -> None:
    model = tiny().build_model(seed=0).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_weights_are_tied_and_stored_once() -> None:
    model = tiny().build_model(seed=0)
    state = model.state_dict()
    assert "wte.weight" in state
    assert not any("lm_head" in key for key in state)
    # The output layer reads the embedding: changing it changes the logits.
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        before = model(tokens)
        model.wte.weight[7] += 1.0
        after = model(tokens)
    assert not torch.allclose(before[..., 7], after[..., 7])


def test_preset_parameter_counts() -> None:
    counts = {name: sum(p.numel() for p in GPT(config).parameters()) for name, config in GPT_PRESETS.items()}
    assert counts["tiny"] < counts["small"] < counts["base"]
    assert 400_000 <= counts["small"] <= 500_000
    assert GPTWorkloadConfig().size == "small"


def test_same_seed_same_init_and_caller_rng_untouched() -> None:
    workload = tiny()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = workload.build_model(seed=5).state_dict()
    assert torch.equal(torch.rand(3), expected_next), "build_model must not consume the global RNG"
    second = workload.build_model(seed=5).state_dict()
    other = workload.build_model(seed=6).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not torch.equal(first["wte.weight"], other["wte.weight"])


def test_batches_deterministic_per_seed_and_differ_across_sites() -> None:
    workload = tiny()
    first = take(workload.site_batches(site=1, num_sites=4, seed=0), 3)
    again = take(tiny().site_batches(site=1, num_sites=4, seed=0), 3)
    for (x1, y1), (x2, y2) in zip(first, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    other_seed = take(workload.site_batches(site=1, num_sites=4, seed=1), 1)[0][0]
    other_site = take(workload.site_batches(site=2, num_sites=4, seed=0), 1)[0][0]
    assert not torch.equal(first[0][0], other_seed)
    assert not torch.equal(first[0][0], other_site)


def test_batches_are_shifted_windows_of_the_site_text() -> None:
    workload = tiny()
    inputs, targets = next(workload.site_batches(site=0, num_sites=4, seed=0))
    assert inputs.shape == targets.shape == (4, 64)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    site_text = bytes(workload.split(4).site_data[0].tolist())
    for row in range(inputs.shape[0]):
        window = bytes(inputs[row].tolist()) + bytes(targets[row, -1:].tolist())
        assert window in site_text


def test_site_modules_disjoint_from_each_other_and_from_eval() -> None:
    workload = tiny()
    split = workload.split(4)
    sites = [set(modules) for modules in split.site_modules]
    assert all(sites)
    for a, b in itertools.combinations(sites, 2):
        assert not a & b
    assert not set(split.eval_modules) & set().union(*sites)
    # Together they cover every top-level module of the corpus exactly once.
    top_level = {source.parts[0] for source in read_source_files(split.root)}
    assert set(split.eval_modules) | set().union(*sites) == top_level
    # The greedy split balances bytes to within a few percent at 4 sites.
    site_bytes = [int(data.numel()) for data in split.site_data]
    assert max(site_bytes) / min(site_bytes) < 1.05


def test_many_sites_split_large_packages_without_sharing_a_file() -> None:
    split = tiny().split(64)
    modules = [module for site_modules in split.site_modules for module in site_modules]
    assert len(set(modules)) == len(modules)
    # No module is inside another one (which would put the same file at two sites).
    owned = set(modules)
    for module in modules:
        parts = module.split("/")
        assert not any("/".join(parts[:depth]) in owned for depth in range(1, len(parts)))
    assert any("/" in module for module in modules), "big packages are refined into sub-modules"
    separators = sum(int((data == DOCUMENT_SEPARATOR[0]).sum()) for data in split.site_data)
    eval_files = int((split.eval_data == DOCUMENT_SEPARATOR[0]).sum())
    assert separators + eval_files == len(read_source_files(split.root))


def test_eval_set_independent_of_site_count_and_seeds() -> None:
    windows = tiny().eval_windows()
    for num_sites, split_seed in [(1, 0), (7, 0), (64, 3)]:
        workload = tiny(split_seed=split_seed)
        workload.split(num_sites)
        assert torch.equal(workload.eval_windows(), windows)
        assert workload.split(num_sites).eval_modules == tiny().split(4).eval_modules
    assert windows.shape == (2 * 4, 65)


def test_eval_loss_deterministic_and_restores_mode() -> None:
    workload = tiny()
    model = workload.build_model(seed=0)
    model.train()
    first = workload.eval_loss(model)
    assert model.training
    model.eval()
    assert workload.eval_loss(model) == first
    assert not model.training
    assert tiny().eval_loss(tiny().build_model(seed=0)) == first
    # An untrained byte model is close to uniform over 256 values.
    assert abs(first - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_adamw_steps_reduce_training_loss() -> None:
    workload = tiny()
    model = workload.build_model(seed=0)
    batch = next(workload.site_batches(site=0, num_sites=2, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    initial = workload.loss(model, batch).item()
    for _ in range(15):
        optimizer.zero_grad()
        workload.loss(model, batch).backward()
        optimizer.step()
    assert workload.loss(model, batch).item() < initial - 0.5


def test_bfloat16_autocast_gives_a_float32_loss() -> None:
    workload = tiny(autocast_dtype="bfloat16")
    model = workload.build_model(seed=0)
    batch = next(workload.site_batches(site=0, num_sites=2, seed=0))
    loss = workload.loss(model, batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    plain = tiny().loss(model, batch)
    assert abs(loss.item() - plain.item()) < 0.05


def test_too_many_sites_and_bad_site_are_rejected() -> None:
    workload = tiny()
    with pytest.raises(ValueError, match=r"site must be in \[0, 4\)"):
        workload.site_batches(site=4, num_sites=4, seed=0)
    with pytest.raises(ValueError, match="exceeds the .* training modules"):
        workload.split(100_000)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_corpus_rules_on_a_custom_root(tmp_path: Path) -> None:
    body = b"def f(x):\n    return x * 2\n" * 40
    _write(tmp_path / "alpha.py", body)
    _write(tmp_path / "beta.py", body)
    _write(tmp_path / "pkg" / "__init__.py", body)
    _write(tmp_path / "pkg" / "core.py", body)
    _write(tmp_path / "pkg" / "tests" / "test_core.py", body)
    _write(tmp_path / "test" / "test_alpha.py", body)
    _write(tmp_path / "site-packages" / "thirdparty.py", body)
    _write(tmp_path / "latin1.py", b"name = '\xe9'\n")
    _write(tmp_path / "notes.txt", body)
    files = read_source_files(resolve_root(str(tmp_path)))
    assert [source.path for source in files] == ["alpha.py", "beta.py", "pkg/__init__.py", "pkg/core.py"]
    split = split_corpus(resolve_root(str(tmp_path)), 2, 0.3, 0)
    # Every module is over half the eval byte target, so the smallest one is held out alone; the
    # package `pkg` is more than a fair share of the rest, so it is dealt file by file.
    assert split.eval_modules == ("alpha.py",)
    assert sorted(m for modules in split.site_modules for m in modules) == [
        "beta.py", "pkg/__init__.py", "pkg/core.py"
    ]
    workload = GPTWorkload(
        GPTWorkloadConfig(size="tiny", seq_len=32, batch_size=2, eval_batches=1, data_root=str(tmp_path))
    )
    inputs, _ = next(workload.site_batches(site=1, num_sites=2, seed=0))
    assert inputs.shape == (2, 32)
    assert workload.eval_windows().shape == (2, 33)


def test_missing_stdlib_sources_raise_a_clear_error(tmp_path: Path) -> None:
    _write(tmp_path / "only_bytecode" / "module.pyc", b"\x00\x01")
    with pytest.raises(CorpusUnavailableError, match="no UTF-8 \\*.py files found under .*data_root"):
        tiny(data_root=str(tmp_path / "only_bytecode")).split(2)
    with pytest.raises(CorpusUnavailableError, match="does not exist"):
        tiny(data_root=str(tmp_path / "missing")).eval_windows()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"size": "huge"}, r"unknown GPT size 'huge'; valid sizes: \['base', 'small', 'tiny'\]"),
        ({"n_embd": 30, "n_head": 4}, "n_embd=30 must be divisible by n_head=4"),
        ({"seq_len": 65}, "seq_len=65 must be between 1 and the model's block_size 64"),
        ({"eval_fraction": 0.9}, "eval_fraction must be in"),
        ({"autocast_dtype": "fp8"}, "unknown autocast_dtype 'fp8'"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
    ],
)
def test_config_validation(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTWorkloadConfig(**{"size": "tiny", **overrides})
