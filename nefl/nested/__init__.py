"""Floor 2: the nested model: architectures and families, TOML ladders, submodel slicing, global state,
local training, data, checkpoints. Imports nefl.support only."""
