"""The example Flower app of nefl-edge: NeFL on Flower's simulation engine and deployment runtime."""
