"""FedJigsaw (arXiv 2608.01861): clients assemble personal models from modules that peers share.

zoo: base architectures, module metadata, valid actions · policy: AttenAssemble + REINFORCE ·
symbio: topology, typed module-exchange messages, source-based aggregation · coretune: centralized critic.
"""
