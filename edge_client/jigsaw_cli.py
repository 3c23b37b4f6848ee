"""`edge-client jigsaw`: take part in a FedJigsaw federation (nefl/jigsaw/device.py) over MQTT.

A sibling of `join` (which trains NeFL submodels an aggregator assigns): the same broker options, device key,
pinned coordinator key, probing for the memory budget and logging; a different protocol, so its own command.
A thread drains the connection's inbox into the device's handler while the main thread trains, so the device
answers its neighbours' fetches during its own training.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import typer

from edge_client.identity import PIN_DIR, device_signer, pin_file_for
from edge_client.join import Membership
from nefl.support.cli_options import DataRootOption, DeviceKeyOption, LogOptions, MemoryBudgetOption, OutOption, ServerKeyOption, ThreadsOption
from nefl.support.extras import full_install_required
from nefl.support.logs import setup_logging
from nefl.support.option_groups import grouped
from nefl.protocol.mqtt import Connection, drain, parse_broker
from nefl.support.signals import Stop, stop_on_sigterm, stop_reason
from nefl.protocol.topics import Topics, check_name

log = logging.getLogger(__name__)


@grouped
def jigsaw_command(
    memory_budget: MemoryBudgetOption("Memory this device may train in, e.g. 40MB (default: what the probe reads as "
                                      "available); the largest base architecture that fits is its model.") = None,
    data_root: DataRootOption = None,
    server_key: ServerKeyOption("The coordinator's public key (`aggregator key` prints it) or a file holding it; "
                                "without it the first plan that lists this device is trusted, with a warning.") = None,
    device_key: DeviceKeyOption() = None,
    out: OutOption = None,
    threads: ThreadsOption() = None,
    *,
    member: Membership,
    logs: LogOptions,
) -> None:
    """Take part in a FedJigsaw federation: assemble a model from neighbours' modules, train it, return them.

    The coordinator's plan names the dataset (under --data-root) and this device's shard of it; with --out, the final
    chain's parameters are written there (final.safetensors)."""
    with full_install_required("edge-client jigsaw"):
        import torch
        from safetensors.torch import save_file

        from nefl.protocol.signing import status_message
        from nefl.jigsaw.device import Abandoned, DeviceSettings, JigsawDevice
        from edge_client.probe import Prober
        from edge_client.select import DeviceBudget
        from nefl.nested.data import DatasetUnavailable
        from nefl.protocol.signing import KeyPin, public_key_arg
    cid, federation = member.cid, member.federation
    setup_logging(logs.log_level, logs.log_format, context={"client": cid})
    stop_on_sigterm()
    try:
        check_name("client id", cid)
        settings = parse_broker(member.broker, *member.mqtt.credentials)
        if threads:
            torch.set_num_threads(threads)
        budget = DeviceBudget.parse(memory_budget).apply(Prober().snapshot()).memory_available
        if not budget:
            raise ValueError("the probe cannot read this device's available memory: give --memory-budget")
        signer = device_signer(cid, device_key)
        pin = KeyPin(public_key_arg(server_key) if server_key else None,
                     pin_file_for(PIN_DIR, federation, settings.host, settings.port))
        topics = Topics(federation)
        conn = Connection(settings, cid, topics.status(cid), lambda seq: status_message(signer, "offline", seq), log)
        device = JigsawDevice(DeviceSettings(cid, federation, int(budget), member.chunk_kib * 1024, data_root), signer, pin,
                              conn.client)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    stop = threading.Event()
    conn.start()
    pumping = threading.Thread(target=drain, args=(conn, device.handle, lambda: device.on_connected(conn.stamp), stop), daemon=True)
    pumping.start()
    code = 0
    try:
        accuracy = device.run()
        if out is not None and device.final_state:
            Path(out).mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in device.final_state.items()}, str(Path(out) / "final.safetensors"))
        log.info("federation over" + (f"; final local test accuracy {accuracy:.4f}" if accuracy is not None else ""))
    except (DatasetUnavailable, ValueError) as e:
        log.error(f"cannot take part: {e}")
        code = 2
    except Abandoned as e:
        log.error(str(e))
        code = 1
    except (KeyboardInterrupt, Stop) as e:
        log.info(f"stopping ({stop_reason(e)}); the neighbours mask this device from the next fetch on")
    finally:
        stop.set()
        conn.stop((topics.status(cid), status_message(signer, "offline", conn.stamp)))
    raise typer.Exit(code)
