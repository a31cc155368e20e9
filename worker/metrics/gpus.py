"""GPU readings from NVML: the Workers page's GPU list and the per-GPU Prometheus gauges.

Read at scrape time by `NvmlCollector`; on a host without NVML nothing is reported.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from service.settings import get_settings
from service.worker_registry import GpuSample

log = logging.getLogger("loraq.worker.metrics")


class NvmlLike(Protocol):
    """The few `pynvml` functions we call (the module itself satisfies this)."""

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...  # bytes from older pynvml
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int: ...


NVML_TEMPERATURE_GPU = 0  # pynvml.NVML_TEMPERATURE_GPU
NVML_CLOCK_SM = 1  # pynvml.NVML_CLOCK_SM

_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {}  # "module": initialised pynvml, or "error": why it is unusable


def load_nvml() -> NvmlLike | None:
    """Initialise NVML once per process; None (and one log line) when the host has none."""
    with _nvml_lock:
        if "module" in _nvml_state:
            return _nvml_state["module"]
        if "error" in _nvml_state:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded...
            _nvml_state["error"] = str(e) or type(e).__name__
            log.info("NVML unavailable (%s): no GPU metrics on this host", _nvml_state["error"])
            return None
        _nvml_state["module"] = pynvml
        return pynvml


def owned_gpu_indices() -> set[int] | None:
    """Host GPU indices this worker owns, or None for all of them.

    NVML sees every GPU of the host whatever CUDA_VISIBLE_DEVICES says, so a worker pinned to one
    GPU must filter, or each worker of a host would report every GPU as its own.
    """
    # LORAQ_WORKER_GPUS, set by worker.launcher per child ("2" or "2,3"), else CUDA's own variable
    for raw in (get_settings().worker_gpus or "", os.environ.get("CUDA_VISIBLE_DEVICES", "")):
        raw = raw.strip()
        if raw and all(p.strip().isdigit() for p in raw.split(",")):
            return {int(p) for p in raw.split(",")}
    return None  # unset, "all", or UUIDs: report every GPU


def read_gpus(nvml: NvmlLike) -> list[GpuSample]:
    """One sample per owned GPU. A GPU whose reading fails is skipped, the others still reported."""
    samples = []
    owned = owned_gpu_indices()
    for index in range(nvml.nvmlDeviceGetCount()):
        if owned is not None and index not in owned:
            continue
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            samples.append(
                GpuSample(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    utilization_percent=float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                    memory_used_bytes=float(mem.used),
                    memory_total_bytes=float(mem.total),
                    temperature_celsius=float(nvml.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)),
                    power_watts=nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # NVML reports milliwatts
                    sm_clock_hertz=nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM) * 1e6,  # MHz
                )
            )
        except Exception:
            log.warning("NVML: reading GPU %d failed", index, exc_info=True)
    return samples


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def local_gpus() -> list[GpuSample]:
    nvml = load_nvml()
    return read_gpus(nvml) if nvml is not None else []


class NvmlCollector:
    """Custom collector: per-GPU gauges read from NVML at scrape time; nothing without NVML."""

    GAUGES = (
        ("loraq_gpu_utilization_percent", "GPU utilisation, last sample period", "utilization_percent"),
        ("loraq_gpu_memory_used_bytes", "GPU memory in use", "memory_used_bytes"),
        ("loraq_gpu_memory_total_bytes", "GPU memory installed", "memory_total_bytes"),
        ("loraq_gpu_temperature_celsius", "GPU core temperature", "temperature_celsius"),
        ("loraq_gpu_power_watts", "GPU power draw", "power_watts"),
        ("loraq_gpu_sm_clock_hertz", "GPU SM clock", "sm_clock_hertz"),
    )

    def __init__(self, nvml: NvmlLike | None = None, *, node: str = "") -> None:
        self._nvml = nvml
        self._node = node

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        nvml = self._nvml if self._nvml is not None else load_nvml()
        if nvml is None:
            return
        samples = read_gpus(nvml)
        if not samples:
            return
        labels = ["worker", "gpu", "uuid", "name"]
        for metric, doc, attr in self.GAUGES:
            family = GaugeMetricFamily(metric, doc, labels=labels)
            for s in samples:
                family.add_metric([self._node, str(s.index), s.uuid, s.name], float(getattr(s, attr)))
            yield family
