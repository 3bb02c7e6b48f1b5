"""The RL update: timelines (an episode's calls -> merged training samples), advantages, the loss, packing, master weights and the trainer step.

It may import engine/ and the foundation only. Timelines live here rather than in episodes/ because
the trainer merges them and train/ sits below episodes/.
"""
