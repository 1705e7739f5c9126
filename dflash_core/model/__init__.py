"""Target capture, the DFlash drafter, its objective, serving export and acceptance eval.

Import the submodules directly: this package stays import-light so that loading a config pulls in no torch.
"""
