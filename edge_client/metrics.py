"""The device's Prometheus metrics: `edge-client join --http` and `edge-client serve`'s /metrics.

join: the probe readings (read when scraped, by a prober of its own, so a scrape never shifts the
CPU-load window the selection reads), the current selection and the limit that binds it, the local
step and training time, and the bytes uploaded. They come from two thin wrappers around the agent's
ports (its Transport and its Device), so the agent itself knows nothing of metrics.

serve: requests and their latency per answering submodel, and refused requests by HTTP status.

Labels are low-cardinality (submodel, binding limit, HTTP status); the device's id is not a label:
Prometheus' scrape target (instance) already names the device.
Nothing here imports torch: `edge-client serve` runs on the small install.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge_client.probe import Prober

if TYPE_CHECKING:
    import torch

    from nefl.protocol.mqtt import Transport
    from edge_client.device import Device
    from edge_client.select import Selection
    from nefl.protocol.messages import DeviceSummary, Task, TrainingSettings
    from nefl.nested.state import Layout
    from nefl.nested.train import TrainResult

BINDINGS = ["none", "memory", "deadline", "cap"]  # edge_client/select.py: which limit set the choice
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TRAIN_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ProbeCollector(Collector):
    """Probe readings as gauges, taken at scrape time; a reading the device cannot make is left out."""

    def __init__(self, prober: Prober) -> None:
        self.prober = prober

    def collect(self) -> Iterator[Metric]:
        s = self.prober.snapshot()
        battery = s.battery
        gpu = s.gpus[0] if s.gpus else None
        readings = [
            ("nefl_device_memory_total_bytes", "Physical memory.", s.memory_total),
            ("nefl_device_memory_available_bytes", "Memory available to new work (before --memory-budget).",
             s.memory_available),
            ("nefl_device_process_rss_bytes", "Resident memory of this edge-client.", s.process_rss),
            ("nefl_device_cpu_percent", "System-wide CPU use since the previous scrape, 0-100.", s.cpu_percent),
            ("nefl_device_external_cpu_percent", "CPU use of everything but this edge-client's process tree, "
             "0-100 (the load selection counts).", s.external_cpu_percent),
            ("nefl_device_load_per_core", "1-minute load average per core (our own work included).", s.load_per_core),
            ("nefl_device_temperature_celsius", "Hottest thermal zone.", s.max_celsius),
            ("nefl_device_throttled", "Raspberry Pi get_throttled bit mask (0: never throttled).", s.throttled),
            ("nefl_device_battery_percent", "Battery charge.", battery.percent if battery else None),
            ("nefl_device_gpu_utilization_percent", "First GPU's utilisation (NVML or Jetson load).",
             gpu.utilization if gpu and gpu.utilization is not None else s.jetson_gpu_load),
            ("nefl_device_gpu_memory_used_bytes", "First GPU's used memory.", gpu.memory_used if gpu else None),
        ]
        for name, doc, value in readings:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))


class DeviceMetrics:
    """`edge-client join --http`: one registry per agent."""

    def __init__(self, prober: Prober | None = None) -> None:
        self.registry = r = CollectorRegistry()
        r.register(ProbeCollector(prober or Prober()))
        self.submodel = Gauge("nefl_device_selected_submodel", "Largest submodel (1-based) the device takes now; "
                              "0: nothing fits.", registry=r)
        self.binding = Enum("nefl_device_selection_binding", "The limit that stops a larger submodel "
                            "(none: the largest fits).", states=BINDINGS, registry=r)
        self.usable = Gauge("nefl_device_usable_memory_bytes", "Memory the selection lets training use "
                            "(after --memory-budget and the safety margin).", registry=r)
        self.step_seconds = Histogram("nefl_device_step_seconds", "Local training step time (a round's training "
                                      "time / its steps).", buckets=STEP_BUCKETS, registry=r)
        self.train_seconds = Histogram("nefl_device_train_seconds", "Local training time per round.",
                                       buckets=TRAIN_BUCKETS, registry=r)
        self.rounds = Counter("nefl_device_rounds_trained", "Rounds this device trained, by submodel.", ["submodel"],
                              registry=r)
        self.loss = Gauge("nefl_device_last_loss", "Training loss of the latest round.", registry=r)
        self.upload_bytes = Counter("nefl_device_upload_bytes", "Update bytes published (resends included).",
                                    registry=r)

    def selection(self, sel: Selection) -> None:
        self.submodel.set(sel.submodel or 0)
        if sel.binding in BINDINGS:
            self.binding.state(sel.binding)
        if sel.usable_memory is not None:
            self.usable.set(sel.usable_memory)

    def trained(self, submodel: int, res: TrainResult) -> None:
        """A finished local round of the 0-based `submodel`."""
        self.rounds.labels(str(submodel + 1)).inc()
        self.train_seconds.observe(res.seconds)
        self.loss.set(res.loss)
        steps = res.metrics.get("steps")
        if steps:
            self.step_seconds.observe(res.seconds / steps)


class MeteredTransport:
    """The agent's Transport, counting the bytes of its update uploads."""

    def __init__(self, transport: Transport, metrics: DeviceMetrics, update_topic: str) -> None:
        self._transport, self._metrics, self._update_topic = transport, metrics, update_topic

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> object:
        if topic == self._update_topic:
            self._metrics.upload_bytes.inc(len(payload))
        return self._transport.publish(topic, payload, qos=qos, retain=retain)

    def subscribe(self, topic: str, qos: int = 0) -> object:
        return self._transport.subscribe(topic, qos=qos)

    def unsubscribe(self, topic: str) -> object:
        return self._transport.unsubscribe(topic)


class MeteredDevice:
    """The agent's Device, recording each selection and each local training."""

    def __init__(self, device: Device, metrics: DeviceMetrics) -> None:
        self._device, self._metrics = device, metrics

    @property
    def samples(self) -> int:
        return self._device.samples

    def summary(self) -> DeviceSummary:
        return self._device.summary()

    def plan(self, layout: Layout, training: TrainingSettings, budget_s: float, cap: int,
             hold: int | None = None) -> Selection:
        sel = self._device.plan(layout, training, budget_s, cap, hold)
        self._metrics.selection(sel)
        return sel

    def train(self, layout: Layout, task: Task, start: dict[str, torch.Tensor], budget_s: float) -> TrainResult:
        res = self._device.train(layout, task, start, budget_s)
        self._metrics.trained(task.submodel, res)
        return res


def instrument(transport: Transport, device: Device, update_topic: str, host: str,
               port: int) -> tuple[MeteredTransport, MeteredDevice]:
    """Serve /metrics on host:port (a background thread) and wrap the agent's ports to feed it."""
    metrics = DeviceMetrics()
    start_http_server(port, host, registry=metrics.registry)
    return MeteredTransport(transport, metrics, update_topic), MeteredDevice(device, metrics)


class InferenceMetrics:
    """`edge-client serve`: requests and latency per answering submodel, refusals by status."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("nefl_inference_requests", "Predictions answered, by submodel (1-based).",
                                ["submodel"], registry=r)
        self.latency = Histogram("nefl_inference_latency_seconds", "Time to decode and classify one request, "
                                 "by the submodel that answered.", ["submodel"], buckets=LATENCY_BUCKETS, registry=r)
        self.failed = Counter("nefl_inference_failed", "Requests answered with an error, by HTTP status.", ["status"],
                              registry=r)

    def answered(self, submodel: int, seconds: float) -> None:
        self.requests.labels(str(submodel)).inc()
        self.latency.labels(str(submodel)).observe(seconds)
