"""Procgen as a native Stable-Baselines3 ``VecEnv``.

:class:`ProcgenVecEnv` drives procgen's natively vectorised C++ environment
(``procgen.ProcgenGym3Env``, gym3 API) directly, instead of one gym env per
process: all ``n_envs`` games live in one C object and are stepped by its own
thread pool, so a whole batch costs one Python call.

gym3 -> SB3 semantics
---------------------
gym3 exposes ``act(actions)`` and ``observe() -> (rew, obs, first)``, where
``first[i]`` is True when ``obs[i]`` is the first frame of a new episode: the
action just taken ended the previous episode and the game reset itself.  SB3
expects ``step_wait() -> (obs, rewards, dones, infos)`` with ``dones[i]`` True
at the step that ended the episode and ``obs[i]`` already the reset frame.
The two line up one-to-one: ``dones = first`` and ``rewards = rew`` (the
reward of the final transition is reported together with ``first``).

Terminal observation
--------------------
Procgen resets a game inside the same C++ ``step()`` call that ends it and
renders only the new level, so the true last frame of an episode is never
exposed.  ``infos[i]["terminal_observation"]`` is therefore the *last frame
the agent observed* in that episode (the frame on which it chose its final
action).  SB3 only uses it to bootstrap ``V(terminal_observation)`` on
time-limit truncation, where the previous frame is a close stand-in.

Time-limit truncation
---------------------
Procgen ends an episode when the game says so *or* when ``cur_time >=
timeout`` (a per-game constant, e.g. 1000 for caveflyer, 500 for maze, 2000
for jumper in memory mode).  Its info dict (``prev_level_seed``,
``prev_level_complete``, ``level_seed``) has no timeout flag.  We read the
game's ``timeout`` once from its serialized state at construction and report
``infos[i]["TimeLimit.truncated"] = (length >= timeout) and not
level_complete`` on every done env.  The only misclassification is an agent
that *dies* on exactly the last allowed step (reported as truncated).  If the
state cannot be parsed (unexpected procgen build), or with
``use_sequential_levels=True`` (where the step counter restarts on every
completed level), truncation is never reported, which is procgen's classic
behaviour (timeouts look terminal).

Episode statistics
------------------
Every done env gets ``infos[i]["episode"] = {"r": return, "l": length, "t":
seconds since construction}`` -- exactly what SB3's ``Monitor`` writes, so SB3
logs ``rollout/ep_rew_mean`` / ``ep_len_mean`` without a ``VecMonitor``.
``r`` is the *game's* (unscaled) return.  ``infos[i]["is_success"]`` is
procgen's ``level_complete`` flag (SB3 logs it as ``rollout/success_rate``).

Importing this module does not import procgen; the native library is loaded
on first construction.
"""

from __future__ import annotations

import operator
import struct
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn

__all__ = [
    "PROCGEN_GAMES",
    "PROCGEN_DISTRIBUTION_MODES",
    "ProcgenVecEnv",
    "make_procgen",
    "normalize_procgen_name",
]

#: The 16 procgen games, in procgen's own order (``procgen.env.ENV_NAMES``).
PROCGEN_GAMES: tuple[str, ...] = (
    "bigfish",
    "bossfight",
    "caveflyer",
    "chaser",
    "climber",
    "coinrun",
    "dodgeball",
    "fruitbot",
    "heist",
    "jumper",
    "leaper",
    "maze",
    "miner",
    "ninja",
    "plunder",
    "starpilot",
)

_EXTREME = frozenset({"chaser", "dodgeball", "leaper", "starpilot"})
_MEMORY = frozenset({"caveflyer", "dodgeball", "heist", "jumper", "maze", "miner"})
_EXPLORATION = frozenset({"coinrun", "caveflyer", "leaper", "jumper", "maze", "heist", "climber", "ninja"})

#: Valid ``distribution_mode`` values per game.  Sources (procgen 0.10.7):
#: ``extreme``/``memory`` from the ``fassert`` in ``Game::parse_options``
#: (src/game.cpp; an unsupported mode aborts the whole process, hence we
#: check in Python first), ``exploration`` from ``EXPLORATION_LEVEL_SEEDS`` in
#: procgen/env.py.  All games support ``easy`` and ``hard``.  Verified by
#: constructing every (game, mode) pair against the installed binary.
PROCGEN_DISTRIBUTION_MODES: dict[str, tuple[str, ...]] = {
    game: tuple(
        mode
        for mode, ok in (
            ("easy", True),
            ("hard", True),
            ("extreme", game in _EXTREME),
            ("memory", game in _MEMORY),
            ("exploration", game in _EXPLORATION),
        )
        if ok
    )
    for game in PROCGEN_GAMES
}

# Extra ``ProcgenGym3Env`` options we forward.  Anything else would reach the
# C++ option parser, whose ``ensure_empty()`` aborts the process on unknown keys.
_PASSTHROUGH_OPTIONS = frozenset(
    {
        "center_agent",
        "use_backgrounds",
        "use_monochrome_assets",
        "restrict_themes",
        "use_generated_assets",
        "paint_vel_info",
        "use_sequential_levels",
        "debug_mode",
    }
)

_INT32_MAX = 2**31 - 1


def normalize_procgen_name(env_name: str) -> str:
    """Map ``"caveflyer"``, ``"procgen:caveflyer"``, ``"procgen-caveflyer-v0"`` or
    ``"procgen:procgen-caveflyer-v0"`` to the bare game name ``"caveflyer"``.

    Raises ``ValueError`` (listing the 16 games) for anything else.
    """
    if not isinstance(env_name, str):
        raise TypeError(f"env_name must be a str, got {type(env_name).__name__}")
    name = env_name.strip().lower()
    if name.startswith("procgen:"):
        name = name[len("procgen:") :]
    if name.startswith("procgen-"):
        name = name[len("procgen-") :]
        if name.endswith("-v0"):
            name = name[: -len("-v0")]
    if name not in PROCGEN_DISTRIBUTION_MODES:
        raise ValueError(
            f"unknown procgen game {env_name!r}; valid games are: {', '.join(PROCGEN_GAMES)} "
            f"(optionally prefixed with 'procgen:')"
        )
    return name


def _check_int(name: str, value: Any, low: int, high: int = _INT32_MAX) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _import_procgen() -> Any:
    """Import ``procgen.ProcgenGym3Env`` lazily with a helpful error."""
    try:
        from procgen import ProcgenGym3Env
    except ImportError as exc:
        raise ImportError(
            "rlseq.envs.make_procgen needs procgen, which is not installed (or failed to import: "
            f"{exc}). Install it with `pip install procgen-mirror` (the maintained wheels of "
            "openai/procgen; it imports as `procgen`)."
        ) from exc
    return ProcgenGym3Env


def _parse_timeout(state: bytes, game: str) -> int | None:
    """Read ``Game::timeout`` from a procgen serialized game state.

    Layout (procgen src/game.cpp ``Game::serialize``, SERIALIZE_VERSION 0):
    int version, string game_name, 9 option ints, 3 option ints, 5 ints
    (grid_step .. game_n), two RandGen (int is_seeded + string state),
    float reward, int done, int level_complete, int action, int timeout.
    Strings are an int length followed by the bytes.  Returns None when the
    buffer does not look like that layout.
    """
    try:
        off = 0

        def read_int() -> int:
            nonlocal off
            (v,) = struct.unpack_from("=i", state, off)  # native order, as C++ wrote it
            off += 4
            return v

        def skip_string() -> bytes:
            nonlocal off
            n = read_int()
            if n < 0 or off + n > len(state):
                raise ValueError("bad string length")
            s = state[off : off + n]
            off += n
            return s

        if read_int() != 0:  # SERIALIZE_VERSION
            return None
        if skip_string() != game.encode():
            return None
        off += 4 * (9 + 3 + 5)
        for _ in range(2):  # level_seed_rand_gen, rand_gen
            read_int()
            skip_string()
        off += 4 * 4  # reward, done, level_complete, action
        timeout = read_int()
    except (struct.error, ValueError):
        return None
    return timeout if 0 < timeout < 10**7 else None


class ProcgenVecEnv(VecEnv):
    """SB3 ``VecEnv`` over procgen's native vectorised env (see module docstring).

    Spaces: ``observation_space = Box(0, 255, (64, 64, 3), uint8)`` (channels
    last, as SB3 expects for images; SB3's ``VecTransposeImage`` makes it
    CHW), ``action_space = Discrete(15)``.

    ``step_wait`` returns ``obs`` uint8 ``[n_envs, 64, 64, 3]``, ``rewards``
    float32 ``[n_envs]``, ``dones`` bool ``[n_envs]`` and ``infos`` (a list of
    ``n_envs`` dicts, empty except on done envs, which carry
    ``terminal_observation``, ``episode``, ``TimeLimit.truncated``,
    ``is_success`` and ``level_seed``).

    ``step_async`` only hands the actions to procgen's worker threads and
    returns (with ``num_threads > 0``), so the caller can overlap work with
    the env step; ``step_wait`` blocks until the batch is done.

    ``reset()`` right after construction (or right after another reset)
    returns the initial frames without touching the games; otherwise it forces
    every game to start a new episode (gym3 action ``-1``), so episode
    statistics always start from zero.  A seed given through SB3's
    :meth:`seed` rebuilds the native env with that seed at the next reset
    (procgen can only be seeded at construction).

    Parameters mirror :func:`make_procgen`.
    """

    def __init__(
        self,
        env_name: str,
        n_envs: int,
        *,
        distribution_mode: str = "easy",
        num_levels: int = 0,
        start_level: int = 0,
        seed: int | None = None,
        num_threads: int | None = None,
        **procgen_options: Any,
    ) -> None:
        game = normalize_procgen_name(env_name)
        n_envs = _check_int("n_envs", n_envs, 1, 1 << 20)
        if distribution_mode not in PROCGEN_DISTRIBUTION_MODES[game]:
            raise ValueError(
                f"invalid distribution_mode {distribution_mode!r} for procgen game {game!r}; "
                f"valid modes for {game} are: {', '.join(PROCGEN_DISTRIBUTION_MODES[game])}"
            )
        num_levels = _check_int("num_levels", num_levels, 0)
        start_level = _check_int("start_level", start_level, 0)
        if start_level + num_levels > _INT32_MAX:  # procgen's level seeds are C ints
            raise ValueError(f"start_level + num_levels must be <= {_INT32_MAX}, got {start_level + num_levels}")
        if distribution_mode == "exploration" and (num_levels != 0 or start_level != 0):
            raise ValueError(
                "distribution_mode='exploration' fixes a single level chosen by procgen; "
                "leave num_levels and start_level at 0"
            )
        if seed is not None:
            seed = _check_int("seed", seed, 0)
        if num_threads is not None:
            num_threads = _check_int("num_threads", num_threads, 0, 1024)
        unknown = set(procgen_options) - _PASSTHROUGH_OPTIONS
        if unknown:
            raise TypeError(
                f"unknown procgen option(s) {sorted(unknown)}; supported extra options: "
                f"{', '.join(sorted(_PASSTHROUGH_OPTIONS))}"
            )

        self.env_name = game
        self.distribution_mode = distribution_mode
        self.num_levels = num_levels
        self.start_level = start_level
        self.num_threads = num_threads
        self.procgen_options = dict(procgen_options)
        self.render_mode = "rgb_array"  # get_images() returns the last frames

        self._gym3_cls = _import_procgen()
        self._env: Any = None
        self._build(n_envs, seed)

        super().__init__(
            num_envs=n_envs,
            observation_space=spaces.Box(0, 255, self._obs_shape, dtype=np.uint8),
            action_space=spaces.Discrete(self._n_actions),
        )
        self._ep_returns = np.zeros(n_envs, dtype=np.float64)
        self._ep_lengths = np.zeros(n_envs, dtype=np.int64)
        self._t_start = time.time()
        self._fresh = True  # the games sit at the first frame of an episode
        self._actions_pending = False

    # -- native env management -------------------------------------------------

    def _build(self, n_envs: int, seed: int | None) -> None:
        """(Re)create the native env and read the initial observation."""
        if self._env is not None:
            self._env.close()
            self._env = None
        kwargs: dict[str, Any] = dict(
            num=n_envs,
            env_name=self.env_name,
            distribution_mode=self.distribution_mode,
            rand_seed=seed,
            **self.procgen_options,
        )
        if self.distribution_mode != "exploration":  # procgen asserts they are absent there
            kwargs.update(num_levels=self.num_levels, start_level=self.start_level)
        if self.num_threads is not None:
            kwargs["num_threads"] = self.num_threads
        self._env = self._gym3_cls(**kwargs)
        self.seed_value = seed
        self._n_actions = int(self._env.ac_space.eltype.n)
        self._obs_shape = tuple(self._env.ob_space["rgb"].shape)
        # gym3 keeps its info buffers as numpy arrays; read them directly
        # instead of get_info(), which builds n_envs dicts and re-observes.
        info_bufs = getattr(self._env, "_info", None)
        self._info_bufs = info_bufs if isinstance(info_bufs, dict) and "prev_level_complete" in info_bufs else None
        self._timeout = self._read_timeout()
        # With use_sequential_levels a completed level does not end the episode
        # but restarts procgen's step counter, so episode length no longer tells
        # a time-out apart from a death: report no truncation then.
        sequential = bool(self.procgen_options.get("use_sequential_levels", False))
        self._truncation_limit = None if sequential else self._timeout
        _, obs, _ = self._env.observe()
        self._last_obs: np.ndarray = obs["rgb"]

    def _read_timeout(self) -> int | None:
        try:
            length = 1 << 20  # procgen's MAX_STATE_SIZE
            buf = self._env._ffi.new(f"char[{length}]")
            n = self._env.call_c_func("get_state", 0, buf, length)
            state = bytes(self._env._ffi.buffer(buf, n))
        except Exception:  # noqa: BLE001 - any failure just disables truncation reporting
            state = b""
        timeout = _parse_timeout(state, self.env_name)
        if timeout is None:
            warnings.warn(
                "could not read the procgen game's timeout; episodes ended by the time limit will not be "
                "reported as TimeLimit.truncated",
                RuntimeWarning,
                stacklevel=3,
            )
        return timeout

    @property
    def timeout(self) -> int | None:
        """The game's episode time limit in steps (None if it could not be read)."""
        return self._timeout

    @property
    def closed(self) -> bool:
        return self._env is None

    def _check_open(self) -> None:
        if self._env is None:
            raise RuntimeError("this ProcgenVecEnv has been closed")

    # -- VecEnv API --------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        self._check_open()
        seed = self._seeds[0] if self._seeds else None
        if seed is not None:
            # SB3's seed() may hand us values up to 2**32 + n; procgen takes a C int.
            self._build(self.num_envs, int(seed) % (_INT32_MAX + 1))
        elif not self._fresh:
            if self._actions_pending:
                self._env.observe()  # let the pending step finish; its result is discarded
            # gym3 action -1 = "force reset": each game steps once with its
            # default action, ends its episode and starts a new level.
            self._env.act(np.full(self.num_envs, -1, dtype=np.int32))
            _, obs, _ = self._env.observe()
            self._last_obs = obs["rgb"]
        self._reset_seeds()
        self._reset_options()
        self._ep_returns[:] = 0.0
        self._ep_lengths[:] = 0
        self._fresh = True
        self._actions_pending = False
        return self._last_obs.copy()

    def step_async(self, actions: np.ndarray) -> None:
        self._check_open()
        actions = np.asarray(actions)
        if actions.size != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got array of shape {actions.shape}")
        actions = actions.reshape(self.num_envs)
        if actions.dtype.kind not in "iu":
            if actions.dtype.kind == "f" and np.all(actions == np.round(actions)):
                pass  # integral floats (e.g. from a float tensor) are fine
            else:
                raise ValueError(f"procgen actions must be integers, got dtype {actions.dtype}")
        # -1 would force a reset inside procgen; reject anything out of range.
        if actions.min() < 0 or actions.max() >= self._n_actions:
            raise ValueError(f"procgen actions must be in [0, {self._n_actions}), got {actions}")
        self._env.act(actions.astype(np.int32))
        self._actions_pending = True

    def step_wait(self) -> VecEnvStepReturn:
        self._check_open()
        if not self._actions_pending:
            raise RuntimeError("step_wait() called without a preceding step_async()")
        rew, obs, first = self._env.observe()  # gym3 returns fresh copies
        self._actions_pending = False
        self._fresh = False
        frames = obs["rgb"]
        dones = first.astype(bool, copy=False)

        self._ep_returns += rew
        self._ep_lengths += 1
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        done_idx = np.flatnonzero(dones)
        if done_idx.size:
            if self._info_bufs is not None:
                complete = self._info_bufs["prev_level_complete"]
                level_seed = self._info_bufs["prev_level_seed"]
            else:  # pragma: no cover - only for gym3 builds without the _info attribute
                raw = self._env.get_info()
                complete = np.array([d["prev_level_complete"] for d in raw])
                level_seed = np.array([d["prev_level_seed"] for d in raw])
            elapsed = round(time.time() - self._t_start, 6)
            for i in done_idx:
                length = int(self._ep_lengths[i])
                success = bool(complete[i])
                infos[i] = {
                    # procgen never shows the true final frame (see module docstring)
                    "terminal_observation": self._last_obs[i],
                    "episode": {"r": float(self._ep_returns[i]), "l": length, "t": elapsed},
                    "TimeLimit.truncated": self._truncation_limit is not None
                    and length >= self._truncation_limit
                    and not success,
                    "is_success": success,
                    "level_seed": int(level_seed[i]),
                }
            self._ep_returns[done_idx] = 0.0
            self._ep_lengths[done_idx] = 0
        self._last_obs = frames
        return frames, rew, dones, infos

    def close(self) -> None:
        """Free the native env (its threads and buffers).  Idempotent."""
        if self._env is not None:
            self._env.close()
            self._env = None

    def get_images(self) -> Sequence[np.ndarray | None]:
        self._check_open()
        return list(self._last_obs)

    # The games all live in one native object, so attribute access is answered
    # by this VecEnv itself, replicated per requested index.
    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        value = getattr(self, attr_name)
        return [value for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        setattr(self, attr_name, value)

    def env_method(self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any) -> list[Any]:
        result = getattr(self, method_name)(*method_args, **method_kwargs)
        return [result for _ in self._get_indices(indices)]

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        # We write Monitor-style episode statistics ourselves; answering True for
        # Monitor lets SB3's evaluate_policy use them and makes VecMonitor warn
        # that it would overwrite them.
        from stable_baselines3.common.monitor import Monitor

        flag = wrapper_class is Monitor
        return [flag for _ in self._get_indices(indices)]

    def _get_indices(self, indices: VecEnvIndices) -> Iterable[int]:
        if indices is None:
            return range(self.num_envs)
        if isinstance(indices, int):
            return [indices]
        return list(indices)

    def __repr__(self) -> str:
        return (
            f"ProcgenVecEnv({self.env_name!r}, n_envs={self.num_envs}, distribution_mode={self.distribution_mode!r}, "
            f"num_levels={self.num_levels}, start_level={self.start_level}, seed={self.seed_value})"
        )


def make_procgen(
    env_name: str,
    n_envs: int,
    *,
    distribution_mode: str = "easy",
    num_levels: int = 0,
    start_level: int = 0,
    seed: int | None = None,
    num_threads: int | None = None,
    **procgen_options: Any,
) -> ProcgenVecEnv:
    """Build an SB3 ``VecEnv`` of ``n_envs`` procgen games in one native env.

    :param env_name: one of :data:`PROCGEN_GAMES`, optionally as
        ``"procgen:<game>"`` (also accepts gym ids ``procgen-<game>-v0``).
    :param n_envs: number of parallel games (>= 1).
    :param distribution_mode: one of ``PROCGEN_DISTRIBUTION_MODES[game]``
        (``easy``/``hard`` everywhere; ``extreme``, ``memory``,
        ``exploration`` for some games, e.g. caveflyer supports ``memory``).
    :param num_levels: number of distinct levels (0 = unlimited).
    :param start_level: lowest level seed (used when ``num_levels > 0``).
    :param seed: seed of procgen's level sampler in ``[0, 2**31)``; the same
        seed gives the same levels and the same first observations.  None =
        random (procgen's default).  SB3 algorithms created with ``seed=``
        call ``env.seed()``, which replaces this seed at their first reset.
    :param num_threads: procgen worker threads (None = procgen's default, 4;
        0 steps synchronously in the calling thread, which is also the only
        fork-safe setting).
    :param procgen_options: extra ``ProcgenGym3Env`` flags, one of
        ``center_agent``, ``use_backgrounds``, ``use_monochrome_assets``,
        ``restrict_themes``, ``use_generated_assets``, ``paint_vel_info``,
        ``use_sequential_levels``, ``debug_mode``.
    :raises ValueError: unknown game, invalid mode for the game, or an
        out-of-range number (the message lists the valid choices).
    :raises ImportError: procgen is not installed (``pip install procgen-mirror``).
    """
    return ProcgenVecEnv(
        env_name,
        n_envs,
        distribution_mode=distribution_mode,
        num_levels=num_levels,
        start_level=start_level,
        seed=seed,
        num_threads=num_threads,
        **procgen_options,
    )
