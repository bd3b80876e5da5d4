"""Reading PEFT adapter directories: the safe opening of a directory and its files
(`directory`), adapter_config.json (`config`), the safetensors weights as held tensors
(`tensors`), and the checked adapter they make (`adapter`)."""
