"""The device agent: probes the device, picks and trains a submodel, runs exported submodels."""
