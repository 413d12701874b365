"""Where lowercache hooks into ExecuTorch: module names only, so importing this is free."""

TOSA_MODULE = "executorch.backends.arm.tosa.backend"  # TOSABackend._preprocess
ETHOSU_MODULE = "executorch.backends.arm.ethosu.backend"  # vela_compile, imported by name
HOOK_MODULES = (TOSA_MODULE, ETHOSU_MODULE)
