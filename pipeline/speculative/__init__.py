"""Speculative decoding as a few verbs: the DFlash drafter and the MTP head, replaying a draft along
a target's text, and the acceptance statistics those replays yield."""
