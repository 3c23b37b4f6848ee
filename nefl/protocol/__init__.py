"""Floor 3: what crosses a process boundary: typed messages, the chunked wire format, signatures, tokens,
MQTT topics and client, the export manifest. Torch-free at import (tensor codecs load torch when called)."""
