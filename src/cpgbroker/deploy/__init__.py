"""Deployment: the files a real cluster runs from (``cpgbroker cluster init``)."""
