"""Architecture families behind one interface (base.py): a module per family (resnet, vit, mobilenet),
its cost function in costs.py (no torch), its registration in registry.py, plus its profiles.
This package file imports nothing, so the torch-free cost code loads without torch."""
