"""The target model: loading (HF folder or GGUF) and layer-id conventions."""
