"""The server side: federation rounds over MQTT, checkpoints, and the research simulator."""
