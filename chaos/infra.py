"""What a scenario needs around the job, set up before it and torn down after
it whatever happens: the network lab, the small volume for disk-full, the
TCP proxies, the control directory.

A scenario that needs something this host cannot give (no root for
namespaces or mounts) still runs: the piece is left out, the reason is kept
in :attr:`Infra.unavailable`, and the faults that needed it are reported as
skipped by :func:`~.campaign.make_injector`, never passed in silence.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from .disk import SmallVolume, mount_unavailable
from .netns import NetLab, netns_unavailable
from .proxy import TcpProxy
from .scenario import Scenario

DEFAULT_VOLUME_BYTES = 256 << 20  # room for a few versions of the demo model


class Infra:
    """``with Infra(sc, run_dir) as infra:`` — then ``infra.netlab``,
    ``infra.durable_path``, ``infra.control_dir``, ``infra.proxy(name,
    upstream)``, ``infra.launch_overrides()`` and ``infra.leak_kwargs()``."""

    def __init__(self, sc: Scenario, run_dir: str | Path, volume_bytes: int = DEFAULT_VOLUME_BYTES) -> None:
        self.sc, self.run_dir, self.volume_bytes = sc, Path(run_dir), volume_bytes
        self.netlab: NetLab | None = None
        self.volume: SmallVolume | None = None
        self.store_volume: SmallVolume | None = None  # the node stores' (snapshot.store_dir), for store-full
        self.proxies: dict[str, TcpProxy] = {}
        self.unavailable: dict[str, str] = {}
        self.control_dir = self.run_dir / "chaos" / "control"
        self._stack = contextlib.ExitStack()

    @property
    def durable_path(self) -> Path | None:
        return self.volume.path if self.volume is not None else None

    @property
    def store_path(self) -> Path | None:
        return self.store_volume.path if self.store_volume is not None else None

    def __enter__(self) -> "Infra":
        self.control_dir.mkdir(parents=True, exist_ok=True)
        try:
            kinds = {f.kind for f in self.sc.faults}
            if self.sc.topology.network == "netns":
                reason = netns_unavailable()
                if reason:
                    self.unavailable["netns"] = reason
                else:
                    self.netlab = self._stack.enter_context(NetLab(self.sc.topology.nodes + self.sc.topology.spares))
            if "disk-full" in kinds:
                reason = mount_unavailable()
                if reason:
                    self.unavailable["disk-full"] = reason
                else:
                    self.volume = self._stack.enter_context(SmallVolume(self.volume_bytes))
            if "store-full" in kinds:
                reason = mount_unavailable()
                if reason:
                    self.unavailable["store-full"] = reason
                else:
                    self.store_volume = self._stack.enter_context(SmallVolume(self.volume_bytes))
        except BaseException:
            self._stack.close()
            raise
        return self

    def proxy(self, name: str, upstream: tuple[str, int], host: str = "127.0.0.1") -> TcpProxy:
        """Start a proxy in front of ``upstream`` (closed on exit); point the
        job's clients at ``proxy.address``. With a network lab, pass
        ``host=infra.netlab.host_address`` so the node namespaces reach it."""
        p = self._stack.enter_context(TcpProxy(upstream, host=host))
        self.proxies[name] = p
        return p

    def launch_overrides(self) -> list[str]:
        """The scenario's ``--set`` list, plus the durable URL: on the small
        volume when the scenario fills the disk, behind the faulty fsspec
        wrapper (``faulty::URL``, flipped through the control channel) when
        it has storage faults."""
        url = self.volume.url if self.volume is not None else None
        if any(f.kind == "storage-flaky" for f in self.sc.faults):
            url = "faulty::" + (url or self.durable_default())
        extra = [f"snapshot.durable_url={url}"] if url else []
        if self.store_volume is not None:
            extra.append(f'snapshot.store_dir="{self.store_volume.path}"')
        return [*self.sc.training.overrides, *extra]

    def durable_plain_url(self) -> str:
        """The durable tier's URL without the faulty wrapper (to verify it)."""
        return self.volume.url if self.volume is not None else self.durable_default()

    def durable_default(self) -> str:
        """The runtime's own default (``RUN_DIR/checkpoints``), made explicit."""
        return (self.run_dir / "checkpoints").resolve().as_uri()

    def leak_kwargs(self) -> dict[str, Any]:
        """Arguments for :func:`~.properties.no_leaks` after teardown: the lab
        and the volume must be gone, and nothing may listen on the proxies'
        ports."""
        return {
            "labs": [self.netlab] if self.netlab is not None else [],
            "mounts": [v.path for v in (self.volume, self.store_volume) if v is not None],
            "ports": [p.address[1] for p in self.proxies.values()],
        }

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
