"""``KernelConfig``: the launch tunables of the PaTH kernels and the routes that the code picks by shape.

Every field defaults to ``None``: the code chooses (``scan``, ``fused``, ``ut_common``, ``ut_backward`` and
``decode`` document each choice beside the function that makes it). A benchmark or a test passes a config to
measure or pin one setting, e.g. ``path_attention_triton(..., config=KernelConfig(bwd_launch=(4, 1, 2)))``.
The config reaches the custom ops as an int (``config_id``), so that ``torch.compile`` sees a constant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    # launch tunables (a leading part may be given: the rest keeps the default)
    fwd_launch: tuple[int, ...] | None = None  # scan forward: (num_warps, num_stages[, unused, maxnreg])
    bwd_launch: tuple[int, ...] | None = None  # scan backward by query chunk: (warps, stages, programs/SM, maxnreg)
    by_sequence_launch: tuple[int, ...] | None = None  # scan backward by sequence: (R query chunks/tile, warps, stages)
    ut_warps: int | None = None  # warps of the UT kernels (not the inverse's)
    group_mib: int | None = None  # recomputing backward: MiB of factors per head group (0 = never split)
    decode_attend: tuple[int, ...] | None = None  # decode split-K attention: (block, warps, stages, programs/SM)
    decode_native: bool | None = None  # decode attention products in the caches' 16-bit dtype (else 3-pass tf32)
    short_conv_tile: tuple[int, int, int] | None = None  # short convolution: (steps, channels, warps)
    # routes picked by shape (True/False pins one)
    v_rows: bool | None = None  # the scan reads v in place, [B, T, Hkv, Dv] (else a chunk copy)
    forward_states: bool | None = None  # the saving route's forward keeps the carried states
    by_sequence: bool | None = None  # with those states, the backward runs by sequence
    delta_pass: bool | None = None  # δ by a pass before the scan backward (else inside it)
    prefetch: bool | None = None  # the backward by query chunk loads the next carried state a pair ahead
    ut_split: bool | None = None  # the UT backward in five kernels (else three)
    ut_half: bool | None = None  # UT products on scaled fp16 operands (else tf32)
    ut_scratch16: bool | None = None  # the three-kernel UT backward's scratch as scaled fp16
    gram16: bool | None = None  # the inverse's W Wᵀ in one pass on 16-bit rows
    ut_split_logits: bool | None = None  # q̃, k̃, S_d by fp32-level products in all chunks / none (else large |q|·|k|)

    def __post_init__(self):
        for name in ("fwd_launch", "bwd_launch", "by_sequence_launch", "decode_attend", "short_conv_tile"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, tuple) or not all(isinstance(x, int) and x >= 0 for x in value):
                    raise ValueError(f"{name} must be a tuple of non-negative ints, got {value!r}")
        if self.by_sequence_launch and self.by_sequence_launch[0] not in (1, 2, 4):
            raise ValueError(f"by_sequence_launch's R must be 1, 2 or 4, got {self.by_sequence_launch!r}")
        if self.ut_warps is not None and self.ut_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ut_warps must be 1, 2, 4, 8 or 16, got {self.ut_warps!r}")
        if self.group_mib is not None and (not isinstance(self.group_mib, int) or self.group_mib < 0):
            raise ValueError(f"group_mib must be a non-negative int, got {self.group_mib!r}")
        if self.decode_attend is not None and (not 1 <= len(self.decode_attend) <= 4
                                               or any(x < 1 for x in self.decode_attend)
                                               or self.decode_attend[0] & (self.decode_attend[0] - 1)):
            raise ValueError(f"decode_attend must be (block[, warps[, stages[, per_sm]]]) with a power-of-two "
                             f"block and positive ints, got {self.decode_attend!r}")
        if self.short_conv_tile is not None and (len(self.short_conv_tile) != 3
                                                 or any(x < 1 or x & (x - 1) for x in self.short_conv_tile)):
            raise ValueError(f"short_conv_tile must be three powers of two (steps, channels, warps), "
                             f"got {self.short_conv_tile!r}")


DEFAULT = KernelConfig()
_IDS: dict[KernelConfig, int] = {DEFAULT: 0}
_CONFIGS: list[KernelConfig] = [DEFAULT]


def config_id(config: KernelConfig | None) -> int:
    """The int that stands for ``config`` in the custom ops' arguments (0: the default)."""
    if config is None:
        return 0
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig or None, got {type(config).__name__}")
    if config not in _IDS:
        _IDS[config] = len(_CONFIGS)
        _CONFIGS.append(config)
    return _IDS[config]


def config_of(ident: int) -> KernelConfig:
    """The config that ``config_id`` gave ``ident``."""
    return _CONFIGS[int(ident)]


def launch(value: tuple[int, ...] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """``default`` with its leading part replaced by ``value`` (a config's launch tuple, or None)."""
    if not value:
        return tuple(default)
    return tuple(value) + tuple(default[len(value):])


def pick(value: bool | None, auto: bool) -> bool:
    """A route: the config's choice if it pins one, else the code's (``auto``)."""
    return auto if value is None else bool(value)
