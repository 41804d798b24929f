"""The yardstick: `gpufeed bench` emulates a training job (DataLoader workers feeding
emulated accelerators) over a source and measures accelerator utilisation (AU)."""
