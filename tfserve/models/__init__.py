"""The model store (a directory of pulled models), the registry of known models, and the one loader every
command uses. Nothing here imports torch at module level: `store` and `registry` stay light so that
`tfserve models list` and shell completion answer instantly; `loading` imports torch when it loads."""
