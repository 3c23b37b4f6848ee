"""ONNX export of every submodel of a checkpoint, with a verified manifest."""
