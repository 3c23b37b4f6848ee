"""ClientApp: each node is client `partition-id` of the simulated population (its Fashion-MNIST shard
and paper tier). On a real device use the probe instead: `client_app(DeviceNode)`."""

from edge_client.flower import client_app

app = client_app()
