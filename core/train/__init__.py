"""The RL update: timelines (an episode's calls -> merged training samples), advantages, the loss, packing, master weights, the trainer step and its typed outcome.

It may import engine/ and the foundation only. Timelines live here rather than in episodes/ because
the trainer merges them and train/ sits below episodes/.
"""
